"""`quark-int4` (read, not written): AMD Quark's int4 and uint4 weight-only exports over groups
(`quant_method: quark`, its `int4_wo_*` and `uint4_wo_*` schemes; harness.formats.quark.int4_weights
says which configs).

AutoAWQ's GEMM layout (harness.formats.awq) under Quark's names, measured on amd-quark 0.13's own
exports (cases/producers/quark/uint4_wo_128, int4_wo_128): for a Linear with N outputs and K inputs in
groups of g (G = K/g), `weight` int32 [K, N/8] (codes packed along the outputs in Quark's `reorder`
order, which is AutoAWQ's), `weight_scale` [G, N] (bfloat16 for a bfloat16 model), `weight_zero_point`
int32 [G, N/8] packed the same way.
- uint4 (`symmetric: false`): unsigned codes q in [0, 15] and zero points z: W = (q - z) * scale.
- int4 (`symmetric: true`): each nibble a two's-complement code in [-8, 7], zero points stored as
  zeros: W = q * scale (vLLM flips each nibble's top bit to read it as uint4b8, code + 8 - 8).
"""

from __future__ import annotations

import re

import torch

from harness.formats import quark
from harness.formats.awq import FORMAT as AWQ
from harness.formats.awq import Awq
from harness.formats.base import FormatError

#: Quark's names -> AutoAWQ's
AWQ_NAMES = {"weight": "qweight", "weight_zero_point": "qzeros", "weight_scale": "scales"}
QUARK_NAMES = {awq: name for name, awq in AWQ_NAMES.items()}
_QUARK_NAMES = re.compile(r"\b(qweight|qzeros|scales)\b")
#: the reading knob: codes are signed two's-complement nibbles (Quark's symmetric int4)
SIGNED = "signed"


def signed_codes(weight) -> bool:
    """Whether Quark's int4 weight spec stores signed codes (int4, symmetric) or unsigned ones with zero
    points (uint4, asymmetric); FormatError for another pairing."""
    signed = weight["dtype"] == "int4"
    if weight.get("symmetric") is not signed:
        raise FormatError(f"Quark's {weight['dtype']} with symmetric={weight.get('symmetric')!r}")
    return signed


def as_awq(tensors):
    return {AWQ_NAMES.get(name, name): t for name, t in tensors.items()}


class QuarkInt4(Awq):
    name = "quark-int4"
    description = "AMD Quark int4/uint4 weight-only (AWQ's packing under Quark's names, signed codes where symmetric)"
    suffixes = ("weight", "weight_scale", "weight_zero_point")
    marker = "weight_scale"

    def matches(self, quantization_config):
        return quark.int4_weights(quantization_config) is not None

    def quantization_config(self, knobs, ignore):
        return quark.fragment(ignore)

    def knobs_from_config(self, quantization_config):
        weight = quark.int4_weights(quantization_config)
        if weight is None:
            raise FormatError("quantization_config is not Quark's int4 or uint4 weight-only scheme over groups")
        return {"group_size": weight["group_size"], SIGNED: signed_codes(weight)}

    def schemes(self, knobs):
        # the kernel an engine needs is AWQ's (vLLM: the same mixed-precision int4 kernels), asked of a
        # format a capability probe can write
        return (AWQ,)

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        """AWQ's quantization under Quark's names: the tensors this format stores, their dtypes and
        shapes (the audit's model of a module); no generator writes this format."""
        result = super().quantize(weight, knobs, model_dtype=model_dtype, activation_amax=activation_amax)
        result.tensors = {name: result.tensors[awq] for name, awq in AWQ_NAMES.items()}
        return result

    def affine_parts(self, tensors, knobs):
        try:
            codes, zeros, scales = super().affine_parts(as_awq(tensors), knobs)
        except FormatError as error:  # said under the names the file holds
            raise FormatError(_QUARK_NAMES.sub(lambda m: QUARK_NAMES[m.group(0)], str(error))) from None
        if knobs.get(SIGNED):
            if bool((zeros != 0).any()):
                raise FormatError(
                    "symmetric int4 (signed codes) stores zero points of 0; weight_zero_point holds others"
                )
            codes = torch.where(codes >= 8, codes - 16, codes)
        return codes, zeros, scales


FORMAT = QuarkInt4()
