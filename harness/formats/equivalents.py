"""Foreign producers' configs over tensors laid out as a format the harness defines, each read as the
config of that format it is equivalent to, so that every reader (the formats, the activation
planner) follows one definition:

- AutoRound's own config (`quant_method: auto-round`): harness.formats.auto_round;
- AMD Quark's own config (`quant_method: quark`): harness.formats.quark;
- ModelOpt's `quant_algo: FP8_PER_CHANNEL_PER_TOKEN`: e4m3 `weight`, one float32 `weight_scale`
  per output row stored 1-D [N], no input scale; dynamic FP8 inputs per token. That is
  compressed-tensors' FP8_DYNAMIC (float-quantized, channel weights, dynamic token inputs) with
  its [N, 1] scales stored [N] (measured on ModelOpt 0.47's own export,
  cases/producers/modelopt/fp8_pc_pt).

- ModelOpt's `quant_algo: FP8_PB_WO` (its FP8_2D_BLOCKWISE_WEIGHT_ONLY config): e4m3 `weight`, one
  float32 `weight_scale` (a multiplier, amax / 448) per 128 x 128 block, inputs not quantized (its
  input quantizers are disabled). That is compressed-tensors' block strategy [128, 128] without
  input activations, its [ceil(N/128), ceil(K/128)] grid stored 4-D [N/128, 1, K/128, 1], 0-D for
  a weight of one block (a [64, 128] k_proj; measured on ModelOpt 0.47's own exports,
  cases/producers/modelopt/fp8_pb_wo and fp8_pb_wo_partial, whose last blocks are partial).

Both foreign per-row FP8 layouts store the row scales 1-D: a config read through this module whose
weights are per channel says so with the reading knob ROW_SCALES_1D (harness.formats.ct_fp8);
ModelOpt's block grid says so with BLOCK_GRID_4D; Quark's 0-D per-tensor scales with SCALAR_SCALES.
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.formats import auto_round, base, quark

#: the reading knob that says a channel strategy's weight_scale is stored [N], not [N, 1]
ROW_SCALES_1D = "row_scales_1d"
#: the reading knob that says a block strategy's weight_scale grid is stored as ModelOpt stores it
#: ([N/bn, 1, K/bk, 1] with its one-block dimensions squeezed), not [N/bn, K/bk]
BLOCK_GRID_4D = "block_grid_4d"
#: the reading knob that says a tensor strategy's weight_scale and input_scale are stored 0-D, not [1]
SCALAR_SCALES = base.SCALAR_SCALES
MODELOPT_PER_CHANNEL = "FP8_PER_CHANNEL_PER_TOKEN"
MODELOPT_BLOCK_WEIGHT_ONLY = "FP8_PB_WO"
#: ModelOpt's FP8_2D_BLOCKWISE_WEIGHT_ONLY block (`block_sizes` {-1: 128, -2: 128})
MODELOPT_BLOCK = [128, 128]


def from_modelopt(config: Mapping) -> bool:
    producer = config.get("producer")
    return config.get("quant_method") == "modelopt" or (
        isinstance(producer, dict) and producer.get("name") == "modelopt"
    )


def modelopt_quant_algo(config: Mapping) -> str | None:
    """quant_algo from config.json's flat form or hf_quant_config.json's nested `quantization`."""
    nested = config.get("quantization")
    source = nested if isinstance(nested, dict) else config
    algo = source.get("quant_algo")
    return str(algo).upper() if algo is not None else None


def _modelopt_fp8(config: Mapping) -> dict | None:
    algo = modelopt_quant_algo(config) if from_modelopt(config) else None
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "dynamic": False}
    if algo == MODELOPT_PER_CHANNEL:
        weights["strategy"] = "channel"
        inputs = dict(weights, strategy="token", dynamic=True)
    elif algo == MODELOPT_BLOCK_WEIGHT_ONLY:
        weights |= {"strategy": "block", "block_structure": list(MODELOPT_BLOCK)}
        inputs = None
    else:
        return None
    group = {"format": "float-quantized", "weights": weights, "input_activations": inputs}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": dict(group, targets=["Linear"])},
        "ignore": list(config.get("ignore") or []),
        "quantization_status": "compressed",
    }


def equivalent_config(config: Mapping) -> dict | None:
    """The config of a defined format that a foreign producer's `config` is equivalent to, or None
    (the config is one of the formats' own, or undefined). UnsupportedFormat / FormatError as
    harness.formats.auto_round says."""
    return auto_round.equivalent_config(config) or _modelopt_fp8(config) or quark.equivalent_config(config)


def read_as(config: Mapping) -> Mapping:
    """`config`, or the defined config it is equivalent to."""
    return equivalent_config(config) or config
