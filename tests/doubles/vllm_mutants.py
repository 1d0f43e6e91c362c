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


def _scaled_last_part(layer, name: str, dim: int, factor: float = 0.5) -> None:
    """`layer.<name>`'s slice for a fused Linear's last part (along `dim`) times `factor` (the parts'
    widths as the method records them, else the layer's own, one device)."""
    names = ("logical_widths", "output_partition_sizes", "output_sizes")
    widths = list(next((getattr(layer, n) for n in names if getattr(layer, n, None)), []))
    if len(widths) > 1:
        getattr(layer, name).data.narrow(dim, sum(widths[:-1]), widths[-1]).mul_(factor)  # BUG


class MutatedStandInMethodsShards(TensorParallelShards):
    """The tensor-parallel lane's worker with four of vLLM's methods that have no kernel here mutated
    in their processing after loading, one mutation each (a checkpoint meets only its own method's):

    - ModelOpt FP8 (per tensor): a fused Linear's part scales differ, the largest is kept and the
      weights are not requantized under it (`requantize_with_max_scale` returns them unchanged);
    - ModelOpt NVFP4: `alpha` from the weight global scale as a divisor (input x 1 / weight), the
      other producer's convention;
    - compressed-tensors MXFP4: every E8M0 scale byte lowered by 2 (an exponent bias applied twice:
      weights 4x too small, compressed-tensors 0.13's MXFP4 bug);
    - FineGrainedFP8 block (`Fp8LinearMethod`): the block scales rounded up to powers of two (UE8M0)
      without requantizing the weights, as a DeepGEMM path may."""

    name = "double-vllm-tp-mutated-stand-in-methods"

    def load(self, directory):
        from contextlib import ExitStack

        import torch
        from vllm.model_executor.layers.quantization import fp8, modelopt
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
            compressed_tensors_w4a4_mxfp4,
        )

        def not_requantized(weight, weight_scale, logical_widths):
            return weight_scale.max(), weight  # BUG: vLLM requantizes each part under the max

        def alpha_as_divisor(layer):
            if hasattr(layer, "weight_global_scale") and hasattr(layer, "input_global_scale"):
                alpha = layer.input_global_scale / layer.weight_global_scale  # BUG: a multiplier, not a divisor
                layer.alpha = torch.nn.Parameter(alpha, requires_grad=False)

        mxfp4 = compressed_tensors_w4a4_mxfp4.CompressedTensorsW4A4Mxfp4
        mxfp4_original = mxfp4.process_weights_after_loading

        def bias_twice(self, layer):
            layer.weight_scale.data -= 2  # BUG
            return mxfp4_original(self, layer)

        block_original = fp8.Fp8LinearMethod.process_weights_after_loading

        def power_of_two(self, layer):
            block_original(self, layer)
            for name in ("weight_scale_inv", "weight_scale"):
                scale = getattr(layer, name, None)
                if scale is not None and scale.numel() > 1:
                    scale.data.copy_(torch.exp2(torch.ceil(torch.log2(scale.data.float()))))  # BUG

        with ExitStack() as stack:
            stack.enter_context(replaced(modelopt, "requantize_with_max_scale", not_requantized))
            stack.enter_context(replaced(modelopt, "maybe_fuse_global_scales", alpha_as_divisor))
            stack.enter_context(replaced(mxfp4, "process_weights_after_loading", bias_twice))
            stack.enter_context(replaced(fp8.Fp8LinearMethod, "process_weights_after_loading", power_of_two))
            return super().load(directory)


class MutatedKernelMethodsVllm(VllmEngine):
    """vLLM with four of its methods that run a kernel here (int8 W8A8 through oneDNN, int4 through
    CPU WNA16) mutated in their processing after loading, one mutation each (a checkpoint meets only
    its own method's); the loaders' weights are untouched:

    - compressed-tensors W8A8 int8 and W4A16 (WNA16): the last fused part's scales halved;
    - GPTQ: the last fused part's scales halved (columns of `scales`);
    - AWQ: its packing order left in place (`_REVERSE_AWQ_PACK_ORDER` the identity), so each word's
      eight values reach the kernel in AWQ's order [0, 2, 4, 6, 1, 3, 5, 7]."""

    name = "double-vllm-mutated-kernel-methods"

    def construct(self, directory, config):
        from contextlib import ExitStack

        from vllm.model_executor.layers.quantization import auto_awq, auto_gptq
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
            compressed_tensors_w8a8_int8,
            compressed_tensors_wNa16,
        )

        def halving(owner, name: str, dim: int):
            original = owner.process_weights_after_loading

            def mutated(self, layer):
                _scaled_last_part(layer, name, dim)
                return original(self, layer)

            return replaced(owner, "process_weights_after_loading", mutated)

        with ExitStack() as stack:
            stack.enter_context(halving(compressed_tensors_w8a8_int8.CompressedTensorsW8A8Int8, "weight_scale", 0))
            stack.enter_context(halving(compressed_tensors_wNa16.CompressedTensorsWNA16, "weight_scale", 0))
            stack.enter_context(halving(auto_gptq.AutoGPTQLinearMethod, "scales", 1))
            stack.enter_context(replaced(auto_awq, "_REVERSE_AWQ_PACK_ORDER", list(range(8))))
            return super().construct(directory, config)


class PreFixMaterializeVllm(VllmEngine):
    """Seed 000's bug class under online quantization: vLLM's layer-wise loader with the
    materialize_layer of before PR #41424 put back (every tensor of the layer replaced, meta or not,
    by uninitialised memory, here NaN): a bias loaded before its layer's loaders were wrapped stays
    garbage. Load it with `[quantization=fp8_per_channel]`."""

    name = "double-vllm-pre-fix-materialize"

    def construct(self, directory, config):
        import torch
        from vllm.model_executor.model_loader.reload import layerwise

        from tests.fixes.vllm_materialize_run import prefix_materialize_layer

        def every_tensor_as_nan(layer, info):  # BUG: every tensor replaced, not only the meta ones
            before = {id(t) for t in [*layer._parameters.values(), *layer._buffers.values()] if t is not None}
            prefix_materialize_layer(layer, info)
            for tensor in [*layer._parameters.values(), *layer._buffers.values()]:
                if tensor is not None and id(tensor) not in before and tensor.is_floating_point():
                    tensor.data.fill_(torch.nan)  # uninitialised memory, made deterministic

        with replaced(layerwise, "materialize_layer", every_tensor_as_nan):
            return super().construct(directory, config)


class OnlineScaleHalvedVllm(VllmEngine):
    """Online FP8 per channel with every Linear's scale halved as its method stores it (the codes
    right): the bug class of a scale read or written in the wrong convention after quantizing.
    Load it with `[quantization=fp8_per_channel]`."""

    name = "double-vllm-online-scale-halved"

    def construct(self, directory, config):
        from vllm.model_executor.layers.quantization.online import fp8

        stored = fp8.replace_parameter

        def halved(layer, name, value):
            return stored(layer, name, value * 0.5 if name == "weight_scale" else value)  # BUG

        with replaced(fp8, "replace_parameter", halved):
            return super().construct(directory, config)


class OnlineKernelLastPartHalvedVllm(VllmEngine):
    """Online FP8 per channel, the codes and scales right as its method makes them, and a fused
    Linear's last part (qkv's v, gate_up's up) scales halved just before its kernel's own processing:
    the kernel applies other weights than those quantized. Load it with `[quantization=fp8_per_channel]`."""

    name = "double-vllm-online-kernel-last-part-halved"

    def construct(self, directory, config):
        from vllm.model_executor.layers.quantization.online import fp8

        method = fp8.Fp8PtpcOnlineLinearMethod
        original = method.process_weights_after_loading

        def halved_for_the_kernel(self, layer):
            kernel_step = self.fp8_linear.process_weights_after_loading

            def halve_then_process(layer):
                widths = list(getattr(layer, "logical_widths", []))
                if len(widths) > 1:
                    layer.weight_scale.data[-widths[-1] :] *= 0.5  # BUG
                return kernel_step(layer)

            self.fp8_linear.process_weights_after_loading = halve_then_process
            try:
                return original(self, layer)
            finally:
                del self.fp8_linear.process_weights_after_loading

        with replaced(method, "process_weights_after_loading", halved_for_the_kernel):
            return super().construct(directory, config)
