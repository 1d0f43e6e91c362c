"""`transformers` on CUDA: from_pretrained(device_map="cuda"), so FineGrainedFP8 keeps its FP8
weights and runs transformers' GPU kernel instead of the CPU dequantize fallback. Used by
scripts/gpu-nightly as `harness.engines.transformers_cuda_engine:TransformersCudaEngine`;
where there is no CUDA device, or no FP8 kernel for FineGrainedFP8, it says so (a skip)."""

from __future__ import annotations

import torch

from harness.engines.transformers_engine import TransformersEngine


def fp8_kernel_missing() -> str | None:
    """Why transformers' FineGrainedFP8 GPU kernel cannot run here, or None when it can."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"FP8 needs compute capability >= 8.9, this GPU has {major}.{minor}"
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel
    except ImportError:  # older releases ship the kernel in-tree, written in Triton
        import importlib.util

        return None if importlib.util.find_spec("triton") else "transformers' FP8 kernel needs triton (not installed)"
    try:
        load_finegrained_fp8_kernel()
    except Exception as error:  # ImportError, a hub download refused offline, a build for another CUDA
        return f"transformers' finegrained-fp8 kernel unavailable: {str(error).splitlines()[0][:300]}"
    return None


class TransformersCudaEngine(TransformersEngine):
    name = "transformers-cuda"
    load_options = {"device_map": "cuda"}

    def unsupported_reason(self, format_name):
        if not torch.cuda.is_available():
            return "no CUDA device"
        reason = super().unsupported_reason(format_name)
        if reason is None and format_name == "fp8-block":
            reason = fp8_kernel_missing()
        return reason
