"""The kernel choices SGLang makes by asking a CUDA driver or a kernel library that this machine
lacks, stood in so that its own loaders and `process_weights_after_loading` run on CPU
(measured: docs/measurements/sglang-cpu.md). Nothing SGLang computes for the weights is replaced:
each stand-in answers a question (which GPU, which rope kernel) or does one per-tensor FP8 rounding
by its CUDA kernel's arithmetic. Each one used is named in the load report's warnings.

- `CompressedTensorsConfig._check_scheme_supported` asks `torch.cuda.get_device_capability()`
  ("Found no NVIDIA driver"): answered with CAPABILITY (default 100, Blackwell: where SGLang runs
  NVFP4 as W4A4; 90, Hopper, makes it choose W4A16, which refuses unfused global scales);
  $HARNESS_SGLANG_CAPABILITY changes it.
- `fp8_kernel.sgl_per_tensor_quant_fp8` is bound on CUDA/XPU/MUSA only (NameError elsewhere); the
  stand-in is `jit/csrc/gemm/per_tensor_quant_fp8.cuh`'s arithmetic: clip(float(x) / scale, +-448)
  to E4M3.
- `RotaryEmbedding.__init__` picks its kernel by platform and, on none it knows, imports
  `vllm._custom_ops` (absent): it is told it is on CPU while the model is built (no forward runs).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

#: the compute capability SGLang's compressed-tensors scheme choice is told
CAPABILITY_VARIABLE = "HARNESS_SGLANG_CAPABILITY"
DEFAULT_CAPABILITY = 100


def capability() -> int:
    return int(os.environ.get(CAPABILITY_VARIABLE) or DEFAULT_CAPABILITY)


@contextmanager
def stood_in(used: list[str]):
    """While active, SGLang's driver-bound kernel choices answer as above; each one SGLang asked
    is appended to `used` once, in words."""
    import sglang.kernels.ops.quantization.fp8_kernel as fp8_kernel
    import sglang.srt.layers.rotary_embedding.base as rotary
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    def note(text: str) -> None:
        if text not in used:
            used.append(text)

    check = CompressedTensorsConfig._check_scheme_supported
    told = capability()

    def check_scheme_supported(self, min_capability: int, error: bool = True) -> bool:
        if torch.cuda.is_available():
            return check(self, min_capability, error)
        note(f"stand-in: no CUDA driver here, SGLang's compressed-tensors scheme choice told capability {told}")
        if min_capability > told and error:
            raise RuntimeError(f"Quantization scheme is not supported for the current GPU (capability {told})")
        return min_capability <= told

    def per_tensor_quant_fp8(input, output_q, output_s, is_static=False):
        note("stand-in: sgl_per_tensor_quant_fp8 (a CUDA kernel) by its arithmetic, clip(x / scale, +-448) to E4M3")
        x = input.float()
        if not is_static:
            output_s.view(-1).copy_((x.abs().max() / 448.0).view(-1))
        inverse = torch.reciprocal(output_s.float().view(-1)[0])
        output_q.copy_((x * inverse).clamp(-448.0, 448.0).to(output_q.dtype))

    bound = hasattr(fp8_kernel, "sgl_per_tensor_quant_fp8")
    on_cpu = rotary._is_cpu
    CompressedTensorsConfig._check_scheme_supported = check_scheme_supported
    if not bound:
        fp8_kernel.sgl_per_tensor_quant_fp8 = per_tensor_quant_fp8
    if not (rotary._is_cpu or rotary._is_cuda):
        rotary._is_cpu = True
        note("stand-in: the rotary embedding's kernel chosen as on CPU (its fallback imports vllm; no forward runs)")
    try:
        yield
    finally:
        CompressedTensorsConfig._check_scheme_supported = check
        if not bound:
            del fp8_kernel.sgl_per_tensor_quant_fp8
        rotary._is_cpu = on_cpu
