"""DELIBERATELY BUGGY TEST DOUBLES of vLLM: the real engine (harness.engines.vllm.engine) with one
step of vLLM's own processing after loading mutated, so that the tests can prove the harness
judges what vLLM's kernels apply, not only what its loaders place. Run under the vLLM
environment's interpreter (HARNESS_<ENGINE>_PYTHON)."""

from __future__ import annotations

from harness.engines.vllm.engine import VllmEngine


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

        scheme.process_weights_after_loading = halved
        try:
            return super().construct(directory, config)
        finally:
            scheme.process_weights_after_loading = original
