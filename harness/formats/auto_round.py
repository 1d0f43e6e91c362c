"""AutoRound's own config (`quant_method: auto-round`) over tensors laid out as another format's.

AutoRound 0.16 writes its config (`bits`, `group_size`, `sym`, `data_type`, `act_*`,
`packing_format`) whatever the layout of the tensors: `auto_round:auto_gptq` and `auto_round` are
GPTQ's (harness.formats.gptq), `auto_round:auto_awq` AWQ's (harness.formats.awq), and
`auto_round:llm_compressor` compressed-tensors' names and encodings. Of the last, NVFP4
(`data_type: nv_fp`, 4 bits, groups of 16, symmetric) is defined here: `weight_packed`,
`weight_scale` (E4M3), `weight_global_scale` a divisor (2688/amax, as compressed-tensors stores it:
measured on AutoRound's own output, cases/producers/autoround/nvfp4_autoround); with
`act_bits: 4` and `act_data_type: nv_fp4_with_static_gs` the inputs are quantized as
compressed-tensors' W4A4 (a stored `input_global_scale` divisor, local scales per 16). Its
equivalent compressed-tensors config groups (`compressed_tensors_groups`) are what the NVFP4
reader and the activation planner read, so both follow one definition.
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.core.errors import FormatError, UnsupportedFormat

AUTO_ROUND = "auto-round"
LLM_COMPRESSOR = "auto_round:llm_compressor"
NVFP4_FORMAT = "nvfp4-pack-quantized"
#: the one activation data type with a stored global scale: compressed-tensors' W4A4
STATIC_NVFP4_INPUTS = "nv_fp4_with_static_gs"
#: bits at or above which AutoRound leaves a tensor unquantized
UNQUANTIZED_BITS = 16


def compressed_tensors_groups(config: Mapping) -> list[dict] | None:
    """The compressed-tensors config groups an AutoRound `auto_round:llm_compressor` NVFP4 config
    is equivalent to; None for any other config. What it declares beyond the definition above (other
    activation types, per-layer `extra_config` with other quantized settings) is UnsupportedFormat."""
    if config.get("quant_method") != AUTO_ROUND or config.get("packing_format") != LLM_COMPRESSOR:
        return None
    if config.get("data_type") != "nv_fp":
        return None
    weights = {
        "num_bits": config.get("bits"),
        "type": "float",
        "group_size": config.get("group_size"),
        "strategy": "tensor_group",
        "symmetric": config.get("sym", True),
        "dynamic": False,
    }
    inputs = None
    act_bits = config.get("act_bits", UNQUANTIZED_BITS)
    extra = config.get("extra_config") or {}
    if not isinstance(act_bits, int) or isinstance(act_bits, bool) or not isinstance(extra, Mapping):
        raise FormatError(f"auto-round act_bits {act_bits!r} or extra_config {type(extra).__name__} is malformed")
    if act_bits < UNQUANTIZED_BITS:
        if config.get("act_data_type") != STATIC_NVFP4_INPUTS or act_bits != 4:
            raise UnsupportedFormat(
                f"auto-round NVFP4 with act_bits={act_bits!r}, act_data_type={config.get('act_data_type')!r} "
                f"(defined here: 4 bits, {STATIC_NVFP4_INPUTS})"
            )
        inputs = dict(weights, group_size=config.get("act_group_size"), dynamic="local")
    for module, settings in extra.items():
        bits = settings.get("bits", UNQUANTIZED_BITS) if isinstance(settings, Mapping) else None
        if not (isinstance(bits, int) and bits >= UNQUANTIZED_BITS):
            raise UnsupportedFormat(f"auto-round extra_config for {module!r} with settings of its own: {settings!r}")
    return [{"format": NVFP4_FORMAT, "weights": weights, "input_activations": inputs, "targets": ["Linear"]}]
