"""DELIBERATELY BUGGY TEST DOUBLES of vLLM: the real engine (harness.engines.vllm.engine), or the
tensor-parallel lane's worker that runs its loaders with stand-in kernels, with one
step of vLLM's own processing after loading mutated, so that the tests can prove the harness
judges what vLLM's kernels apply, not only what its loaders place. Run under the vLLM
environment's interpreter (HARNESS_<ENGINE>_PYTHON)."""

from __future__ import annotations

from contextlib import contextmanager

from harness.engines.vllm.engine import VllmEngine
from harness.engines.vllm.tensor_parallel.worker import TensorParallelShards


@contextmanager
def replaced(owner, name: str, value):
    """`owner.name` replaced by `value` (the mutation) for the block, restored afterwards."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


class LastPartScaleHalvedAfterLoadingVllm(VllmEngine):
    """compressed-tensors FP8 Linears: the scale of a fused Linear's last part (qkv's v, gate_up's
    up) halved in process_weights_after_loading, before vLLM's own processing: the bug class of a
    merged scale fused or requantized wrong after loading. The loaders' weights are untouched."""

    name = "double-vllm-last-part-scale-halved-after-loading"

    def construct(self, directory, config):
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w8a8_fp8

        scheme = compressed_tensors_w8a8_fp8.CompressedTensorsW8A8Fp8
        original = scheme.process_weights_after_loading

        def halved(self, layer):
            widths = list(getattr(layer, "logical_widths", []))
            if len(widths) > 1:
                layer.weight_scale.data[-widths[-1] :] *= 0.5  # BUG
            return original(self, layer)

        with replaced(scheme, "process_weights_after_loading", halved):
            return super().construct(directory, config)


class RequantizedUnderSmallestScaleShards(TensorParallelShards):
    """The tensor-parallel lane's worker with vLLM's per-tensor FP8 processing after loading
    mutated: a fused Linear's parts requantized under the smallest part scale instead of the
    largest (`requantize_with_max_scale` with min): the parts with larger scales saturate."""

    name = "double-vllm-tp-requantized-under-smallest-scale"

    def load(self, directory):
        from vllm.model_executor.layers.quantization.utils import w8a8_utils

        def under_smallest(weight, weight_scale, logical_widths):
            from vllm import _custom_ops as ops

            smallest = weight_scale.min()  # BUG: vLLM takes the max
            start = 0
            for index, width in enumerate(logical_widths):
                dequantized = w8a8_utils.per_tensor_dequantize(weight[start : start + width], weight_scale[index])
                weight[start : start + width], _ = ops.scaled_fp8_quant(dequantized, smallest)
                start += width
            return smallest, weight

        with replaced(w8a8_utils, "requantize_with_max_scale", under_smallest):
            return super().load(directory)


class AlphaNotInvertedShards(TensorParallelShards):
    """The tensor-parallel lane's worker with vLLM's compressed-tensors NVFP4 W4A4 processing after
    loading mutated: `alpha` computed from the activation's global scale as stored (the divisor)
    instead of its inverse."""

    name = "double-vllm-tp-nvfp4-alpha-not-inverted"

    def load(self, directory):
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
            compressed_tensors_w4a4_nvfp4,
        )

        scheme = compressed_tensors_w4a4_nvfp4.CompressedTensorsW4A4Fp4
        original = scheme.process_weights_after_loading

        def not_inverted(self, layer):
            original(self, layer)
            if hasattr(layer, "alpha"):
                layer.alpha.data = layer.input_global_scale_inv * layer.weight_global_scale  # BUG

        with replaced(scheme, "process_weights_after_loading", not_inverted):
            return super().load(directory)


class ExpertDownGlobalScaleNotInvertedShards(TensorParallelShards):
    """The tensor-parallel lane's worker with vLLM's compressed-tensors NVFP4 MoE processing after
    loading mutated: every expert's w2 global scale handed to the kernel format as stored (the
    divisor) instead of inverted into a multiplier."""

    name = "double-vllm-tp-nvfp4-moe-w2-global-scale-not-inverted"

    def load(self, directory):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_w4a4_nvfp4,
        )

        scheme = compressed_tensors_moe_w4a4_nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod
        original = scheme.process_weights_after_loading

        def not_inverted(self, layer):
            layer.w2_weight_global_scale.data = 1.0 / layer.w2_weight_global_scale.data  # BUG: vLLM inverts it once
            return original(self, layer)

        with replaced(scheme, "process_weights_after_loading", not_inverted):
            return super().load(directory)
