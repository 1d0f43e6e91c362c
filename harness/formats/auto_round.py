"""AutoRound's own config (`quant_method: auto-round`) over tensors laid out as another format's.

AutoRound 0.16 writes its config (`bits`, `group_size`, `sym`, `data_type`, `act_*`,
`packing_format`) whatever the layout of the tensors: `auto_round:auto_gptq` and `auto_round` are
GPTQ's (harness.formats.gptq), `auto_round:auto_awq` AWQ's (harness.formats.awq), and
`auto_round:llm_compressor` compressed-tensors' names and encodings. Of the last, two are defined
here, each as the compressed-tensors config it is equivalent to (`equivalent_config`),
which the compressed-tensors readers and the activation planner read, so that both follow one
definition:

- NVFP4 (`data_type: nv_fp`, 4 bits, groups of 16, symmetric): `weight_packed`, `weight_scale`
  (E4M3), `weight_global_scale` a divisor (2688/amax, as compressed-tensors stores it: measured on
  AutoRound's own output, cases/producers/autoround/nvfp4_autoround); with `act_bits: 4` and
  `act_data_type: nv_fp4_with_static_gs` the inputs are quantized as compressed-tensors' W4A4 (a
  stored `input_global_scale` divisor, local scales per 16).
- MXFP4 (`data_type` of the `mx_fp` family, 4 bits, groups of 32, symmetric): `weight_packed`
  (E2M1) and a uint8 E8M0 `weight_scale` per 32 columns, compressed-tensors'
  `mxfp4-pack-quantized` (measured on AutoRound's own output,
  cases/producers/autoround/mxfp4_autoround); `act_bits: 4` with `act_data_type` `mx_fp` (or
  `mx_fp4`, `mx_fp4e2m1`), dynamic, groups of 32, declares OCP MX FP4 activations as AutoRound's
  `quant_mx` computes them (harness.oracle.activations); its `_rceil` types (MXFP4_RCEIL) round
  the scale exponent up instead, as its `quant_mx_rceil` does (measured on its own output,
  cases/producers/autoround/mxfp4_rceil_autoround).

`auto_round:fp8` (`data_type: fp`, 8 bits, `fmt: e4m3`, `group_size` [bn, bk], dynamic FP8 inputs
in groups of bk) is transformers' FineGrainedFP8 layout, DeepSeek's: `weight` (e4m3) and a float32
`weight_scale_inv` block grid, a multiplier despite its name (measured on AutoRound's own output,
cases/producers/autoround/fp8_block_autoround); its equivalent is that config (`quant_method: fp8`).

One more of its packings keeps compressed-tensors' tensor names under another config:
`auto_round:fp8_static` (`data_type: fp`, 8 bits, `fmt: e4m3`, `group_size: -1`) is FP8 weights
`weight` (e4m3) with one float32 `weight_scale` per output row, stored 1-D [N]
(compressed-tensors stores [N, 1]: harness.formats.equivalents.ROW_SCALES_1D), and a static
per-tensor float32 `input_scale` [1] (`act_bits: 8`, `act_dynamic: false`): compressed-tensors'
float-quantized channel strategy with static inputs (measured on AutoRound's own output,
cases/producers/autoround/fp8_static_autoround). Every reader reaches these translations through
harness.formats.equivalents.

Other data types under `auto_round:llm_compressor` (MXFP8, ...) are UnsupportedFormat, as are
activation types beyond these and per-layer `extra_config` with quantized settings of its own. The
modules `extra_config` leaves in 16 bits (a mixture's routers, a Linear whose width its groups do
not divide) and the routers it never quantizes are the equivalent config's ignore list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from harness.core.errors import FormatError, UnsupportedFormat
from harness.formats.base import ROUTERS

AUTO_ROUND = "auto-round"
LLM_COMPRESSOR = "auto_round:llm_compressor"
NVFP4_FORMAT = "nvfp4-pack-quantized"
MXFP4_FORMAT = "mxfp4-pack-quantized"
FP8_STATIC = "auto_round:fp8_static"
FP8_BLOCK = "auto_round:fp8"
FLOAT_FORMAT = "float-quantized"
#: the one NVFP4 activation data type with a stored global scale: compressed-tensors' W4A4
STATIC_NVFP4_INPUTS = "nv_fp4_with_static_gs"
#: AutoRound's activation data types quantized by its `quant_mx` (OCP MX: a floor of log2 of the amax)
OCP_MXFP4_INPUTS = ("mx_fp", "mx_fp4", "mx_fp4e2m1")
#: the suffix of its RCEIL variants (`quant_mx_rceil`: the scale exponent ceil(log2(amax / 6)))
RCEIL = "_rceil"
MXFP4_INPUTS = OCP_MXFP4_INPUTS + tuple(name + RCEIL for name in OCP_MXFP4_INPUTS)
#: bits at or above which AutoRound leaves a tensor unquantized
UNQUANTIZED_BITS = 16


def _is_mx(data_type) -> bool:
    """AutoRound's MX family (`mx_fp`, `mx_fp4`, `mx_fp4e2m1`, ...), matched by substring as its
    own `is_mx_fp` does."""
    return isinstance(data_type, str) and "mx_fp" in data_type


def _act_bits(config: Mapping) -> int:
    act_bits = config.get("act_bits", UNQUANTIZED_BITS)
    extra = config.get("extra_config") or {}
    if not isinstance(act_bits, int) or isinstance(act_bits, bool) or not isinstance(extra, Mapping):
        raise FormatError(f"auto-round act_bits {act_bits!r} or extra_config {type(extra).__name__} is malformed")
    for module, settings in extra.items():
        bits = settings.get("bits", UNQUANTIZED_BITS) if isinstance(settings, Mapping) else None
        if not (isinstance(bits, int) and bits >= UNQUANTIZED_BITS):
            raise UnsupportedFormat(f"auto-round extra_config for {module!r} with settings of its own: {settings!r}")
    return act_bits


def sixteen_bits(config: Mapping) -> list[str]:
    """What AutoRound leaves in 16 bits, as the equivalent config's ignore list: whatever lies outside
    the blocks it quantizes, each module `extra_config` names (after _act_bits, which refuses any
    entry with quantized settings of its own; a regular-expression key, as its export writes
    `.*model\\.layers\\.0\\.mlp\\.gate.*`, as a `re:` entry) and the routers: AutoRound 0.16 never
    quantizes them, whatever extra_config says (its special_model_handler keeps every `.gate` and
    `.shared_expert_gate` in 16 bits) and names them there only where its own list of them matched
    (for a Mixtral, a `mlp.gate` the model lacks: cases/producers/autoround/mixtral_mxfp4_autoround)."""
    named = [f"re:{key}" if any(c in key for c in "\\*[(") else key for key in config.get("extra_config") or {}]
    return outside_blocks(config) + named + list(ROUTERS)


def outside_blocks(config: Mapping) -> list[str]:
    """Every module outside `block_name_to_quantize` (a name, a comma-separated string of them or a
    list; the head and the embeddings of a decoder) as one `re:` entry; `lm_head` without it."""
    blocks = config.get("block_name_to_quantize")
    names = blocks.split(",") if isinstance(blocks, str) else blocks if isinstance(blocks, list) else []
    names = [name.strip() for name in names if isinstance(name, str) and name.strip()]
    if not names:
        return ["lm_head"]
    return ["re:^(?!" + "|".join(re.escape(name) + "\\." for name in names) + ")"]


def _unsupported_inputs(config: Mapping, act_bits: int, defined: str) -> UnsupportedFormat:
    return UnsupportedFormat(
        f"auto-round {config.get('data_type')} with act_bits={act_bits!r}, "
        f"act_data_type={config.get('act_data_type')!r} (defined here: {defined})"
    )


def _nvfp4_group(config: Mapping, act_bits: int) -> dict:
    weights = {
        "num_bits": config.get("bits"),
        "type": "float",
        "group_size": config.get("group_size"),
        "strategy": "tensor_group",
        "symmetric": config.get("sym", True),
        "dynamic": False,
    }
    inputs = None
    if act_bits < UNQUANTIZED_BITS:
        if config.get("act_data_type") != STATIC_NVFP4_INPUTS or act_bits != 4:
            raise _unsupported_inputs(config, act_bits, f"4 bits, {STATIC_NVFP4_INPUTS}")
        inputs = dict(weights, group_size=config.get("act_group_size"), dynamic="local")
    return {"format": NVFP4_FORMAT, "weights": weights, "input_activations": inputs}


def _mxfp4_group(config: Mapping, act_bits: int) -> dict:
    if config.get("bits") != 4:
        raise UnsupportedFormat(f"auto-round {config.get('data_type')} with {config.get('bits')!r} bits (MXFP4 only)")
    weights = {
        "num_bits": 4,
        "type": "float",
        "group_size": config.get("group_size"),
        "strategy": "group",
        "symmetric": config.get("sym", True),
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    }
    inputs = None
    if act_bits < UNQUANTIZED_BITS:
        dynamic = config.get("act_dynamic", True) is True
        if not (config.get("act_data_type") in MXFP4_INPUTS and act_bits == 4 and dynamic):
            raise _unsupported_inputs(config, act_bits, f"4 bits, one of {', '.join(MXFP4_INPUTS)}, dynamic")
        inputs = dict(weights, group_size=config.get("act_group_size"), dynamic=True)
    return {"format": MXFP4_FORMAT, "weights": weights, "input_activations": inputs}


def _fp8_static_group(config: Mapping, act_bits: int) -> dict:
    declared = {key: config.get(key) for key in ("data_type", "bits", "fmt", "group_size")}
    if declared != {"data_type": "fp", "bits": 8, "fmt": "e4m3", "group_size": -1}:
        raise UnsupportedFormat(f"auto-round {FP8_STATIC} with {declared} (defined here: fp, 8 bits, e4m3, per row)")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel"}
    inputs = None
    if act_bits < UNQUANTIZED_BITS:
        if (act_bits, config.get("act_data_type"), config.get("act_dynamic")) != (8, "fp", False):
            raise _unsupported_inputs(config, act_bits, "8 bits, fp, static per tensor")
        inputs = dict(weights, strategy="tensor", dynamic=False)
    return {"format": FLOAT_FORMAT, "weights": dict(weights, dynamic=False), "input_activations": inputs}


def _fine_grained_fp8(config: Mapping, act_bits: int) -> dict:
    declared = {key: config.get(key) for key in ("data_type", "bits", "fmt")}
    block = config.get("group_size")
    if declared != {"data_type": "fp", "bits": 8, "fmt": "e4m3"} or not (isinstance(block, list) and len(block) == 2):
        raise UnsupportedFormat(
            f"auto-round {FP8_BLOCK} with {declared}, group_size {block!r} (defined here: e4m3 blocks)"
        )
    inputs = (act_bits, config.get("act_data_type"), config.get("act_dynamic"), config.get("act_group_size"))
    if inputs != (8, "fp", True, block[1]):
        raise _unsupported_inputs(config, act_bits, f"8 bits, fp, dynamic, groups of {block[1]}")
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}


def equivalent_config(config: Mapping) -> dict | None:
    """The quantization_config an AutoRound config is equivalent to: compressed-tensors' for
    `auto_round:llm_compressor` and `auto_round:fp8_static` (one config group for every quantized
    Linear), transformers' FineGrainedFP8 for `auto_round:fp8`; None for any other config. What it
    declares beyond the definitions above is UnsupportedFormat, a malformed field FormatError."""
    if config.get("quant_method") != AUTO_ROUND:
        return None
    data_type = config.get("data_type")
    if config.get("packing_format") == FP8_BLOCK:
        return _fine_grained_fp8(config, _act_bits(config)) | {"modules_to_not_convert": sixteen_bits(config)}
    if config.get("packing_format") == FP8_STATIC:
        group = _fp8_static_group(config, _act_bits(config))
    elif config.get("packing_format") != LLM_COMPRESSOR:
        return None
    elif data_type == "nv_fp":
        group = _nvfp4_group(config, _act_bits(config))
    elif _is_mx(data_type):
        group = _mxfp4_group(config, _act_bits(config))
    else:
        return None
    group["targets"] = ["Linear"]
    return {
        "quant_method": "compressed-tensors",
        "format": group["format"],
        "config_groups": {"group_0": group},
        "ignore": sixteen_bits(config),
        "quantization_status": "compressed",
    }
