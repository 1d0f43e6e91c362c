"""Foreign producers' configs over tensors laid out as a format the harness defines, each read as the
config of that format it is equivalent to, so that every reader (the formats, the activation
planner) follows one definition:

- AutoRound's own config (`quant_method: auto-round`): harness.formats.auto_round;
- ModelOpt's `quant_algo: FP8_PER_CHANNEL_PER_TOKEN`: e4m3 `weight`, one float32 `weight_scale`
  per output row stored 1-D [N], no input scale; dynamic FP8 inputs per token. That is
  compressed-tensors' FP8_DYNAMIC (float-quantized, channel weights, dynamic token inputs) with
  its [N, 1] scales stored [N] (measured on ModelOpt 0.47's own export,
  cases/producers/modelopt/fp8_pc_pt).

Both foreign per-row FP8 layouts store the row scales 1-D: a config read through this module whose
weights are per channel says so with the reading knob ROW_SCALES_1D (harness.formats.ct_fp8).
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.formats import auto_round

#: the reading knob that says a channel strategy's weight_scale is stored [N], not [N, 1]
ROW_SCALES_1D = "row_scales_1d"
MODELOPT_PER_CHANNEL = "FP8_PER_CHANNEL_PER_TOKEN"


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


def _modelopt_per_channel(config: Mapping) -> dict | None:
    if not (from_modelopt(config) and modelopt_quant_algo(config) == MODELOPT_PER_CHANNEL):
        return None
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel"}
    inputs = dict(weights, strategy="token", dynamic=True)
    group = {"format": "float-quantized", "weights": dict(weights, dynamic=False), "input_activations": inputs}
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
    return auto_round.equivalent_config(config) or _modelopt_per_channel(config)


def read_as(config: Mapping) -> Mapping:
    """`config`, or the defined config it is equivalent to."""
    return equivalent_config(config) or config
