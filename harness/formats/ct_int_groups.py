"""`ct-w4a8` (read, not written): compressed-tensors `int-quantized` int4 weights per group with
quantized inputs, as llm-compressor 0.14 saves its W4A8 and W4AFP8 presets.

compressed-tensors packs int4 codes (`pack-quantized`, harness.formats.ct_int4) only for a
weight-only scheme; a scheme that also quantizes its inputs is saved `int-quantized`: the codes
unpacked, one int8 per element. Measured on llm-compressor 0.14's own exports
(cases/producers/llmcompressor/llama-w4a8, llama-w4afp8): `weight` int8 [N, K] holding codes in
[-8, 7] (two's complement), `weight_scale` in the model dtype [N, ceil(K/g)], symmetric, no zero
point; W = code * weight_scale[row, column // g]. Config: one config group, int 4-bit `group` weights
of `group_size` g, dynamic per-token inputs: int8 (W4A8) or FP8 (W4AFP8), read by
harness.oracle.activations from the config as every other format's.

Scales and codes are compressed-tensors' (harness.formats.ct_int4: the same `calculate_qparams`
and rounding as its pack-quantized int4); only the container differs.
"""

from __future__ import annotations

import torch

from harness.core.errors import UnsupportedFormat
from harness.formats.base import FormatError, Knob, QuantFormat
from harness.formats.ct_common import single_group_config
from harness.formats.ct_int4 import GROUP_SIZES, code_range
from harness.formats.ct_w8a8 import FORMAT_NAME, quantize_codes, read_codes
from harness.formats.ct_w8a8 import config_group as int_quantized_group

BITS = 4


def require_int4_codes(weight: torch.Tensor) -> None:
    """FormatError where an int8 `weight` holds a value no int4 code has."""
    qmin, qmax = code_range(BITS)
    outside = int(((weight < qmin) | (weight > qmax)).sum())
    if outside:
        raise FormatError(f"weight holds {outside} value(s) outside int{BITS}'s [{qmin}, {qmax}]")


class CtIntGroups(QuantFormat):
    name = "ct-w4a8"
    description = (
        "compressed-tensors int-quantized int4 weights per group, one int8 per code, with quantized inputs "
        "(llm-compressor's W4A8 and W4AFP8)"
    )
    suffixes = ("weight", "weight_scale")
    marker = "weight_scale"
    knobs = {"group_size": Knob(128, GROUP_SIZES, "columns that share one weight_scale")}

    def matches(self, quantization_config):
        return int_quantized_group(quantization_config, BITS) is not None

    def quantization_config(self, knobs, ignore):
        """The weights' part of the config (no generator writes this format; its inputs are a preset's)."""
        weights = {"dynamic": False, "num_bits": BITS, "strategy": "group", "symmetric": True, "type": "int"}
        return single_group_config(FORMAT_NAME, weights | {"group_size": knobs["group_size"]}, ignore)

    def knobs_from_config(self, quantization_config):
        group = int_quantized_group(quantization_config, BITS)
        if group is None:
            raise FormatError(f"quantization_config is not compressed-tensors {FORMAT_NAME} int{BITS}")
        weights = group["weights"]
        wanted = {"strategy": "group", "symmetric": True}
        wrong = {key: weights.get(key) for key, value in wanted.items() if weights.get(key, True) != value}
        if wrong or weights.get("actorder") not in (None, "static", "weight"):
            raise UnsupportedFormat(
                f"compressed-tensors {FORMAT_NAME} int{BITS} with {wrong or {'actorder': weights.get('actorder')}} "
                f"weights (the harness defines {wanted} only)"
            )
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise FormatError(f"group_size {size!r} is not a positive int")
        return {"group_size": size}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        """compressed-tensors' int4 codes and scales (as ct-int4's symmetric ones), unpacked: the
        tensors this format stores (the audit's model of a module); no generator writes it."""
        return quantize_codes(weight, BITS, knobs["group_size"], model_dtype)

    def dequantize(self, tensors, knobs):
        group = knobs["group_size"]
        weight, scale = read_codes(tensors, group)
        require_int4_codes(weight)  # last: the first check that reads the codes' values
        column_group = torch.arange(weight.shape[1]) // group
        return weight.to(torch.float64) * scale.to(torch.float64)[:, column_group]

    def scale_block(self, knobs, shape):
        return 1, knobs["group_size"]


FORMAT = CtIntGroups()
