"""`quark-mxfp4` (read, not written): AMD Quark's OCP MXFP4 export (`quant_method: quark`, its
`mxfp4` and `mxfp4_weight_only` schemes; harness.formats.quark.is_mxfp4 says which configs).

compressed-tensors' MXFP4 tensors (harness.formats.ct_mxfp4) under Quark's names, measured on
amd-quark 0.13's own export (cases/producers/quark/mxfp4): `weight` uint8 [N, K/2] (E2M1 codes, even
column in the low nibble) and `weight_scale` uint8 [N, K/32] (E8M0, biased exponents):
W = e2m1 * 2**(weight_scale - 127). Its inputs, where quantized, are dynamic MXFP4 with Quark's
`even` scale rounding (harness.oracle.activations), or (its `mxfp4_fp8` scheme, cases/producers/
quark/mxfp4_fp8) static FP8 per tensor with a bfloat16 0-D `input_scale`.
"""

from __future__ import annotations

import torch

from harness.core.numerics import E4M3_MAX
from harness.formats import equivalents, quark
from harness.formats.base import FormatError, require_dtype, require_finite, require_shape, require_tensor
from harness.formats.ct_mxfp4 import FORMAT as CT_MXFP4
from harness.formats.ct_mxfp4 import CtMxfp4

#: Quark's name -> compressed-tensors'
CT_NAMES = {"weight": "weight_packed"}
#: the reading knob: static FP8 per-tensor inputs (`mxfp4_fp8`), their scale stored 0-D
FP8_INPUTS = "fp8_inputs"


class QuarkMxfp4(CtMxfp4):
    name = "quark-mxfp4"
    description = "AMD Quark MXFP4 (uint8 weight of E2M1 codes, uint8 E8M0 weight_scale per 32 columns)"
    suffixes = ("weight", "weight_scale", "input_scale")
    marker = "weight_scale"
    knobs = {}

    def matches(self, quantization_config):
        return quark.is_mxfp4(quantization_config)

    def quantization_config(self, knobs, ignore):
        return quark.fragment(ignore)

    def knobs_from_config(self, quantization_config):
        if not quark.is_mxfp4(quantization_config):
            raise FormatError("quantization_config is not Quark's MXFP4 scheme")
        inputs = quantization_config["global_quant_config"].get("input_tensors")
        return {FP8_INPUTS: True, equivalents.SCALAR_SCALES: True} if quark.fp8_static_tensor(inputs) else {}

    def schemes(self, knobs):
        # the kernel an engine needs is MXFP4's, asked of a format a capability probe can write
        return (CT_MXFP4,)

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        """compressed-tensors' MXFP4 quantization under Quark's names: the tensors this format stores,
        their dtypes and shapes (the audit's model of a module); no generator writes this format."""
        result = super().quantize(weight, knobs, model_dtype=model_dtype, activation_amax=activation_amax)
        result.tensors = {"weight": result.tensors["weight_packed"], "weight_scale": result.tensors["weight_scale"]}
        if knobs.get(FP8_INPUTS):  # Quark's FP8 input scale: amax / 448 in the model dtype, 0-D
            result.tensors["input_scale"] = torch.tensor(float(activation_amax) / E4M3_MAX, dtype=model_dtype)
        return result

    def dequantize(self, tensors, knobs):
        if knobs.get(FP8_INPUTS):
            scale = require_tensor(tensors, "input_scale")
            require_dtype("input_scale", scale, (torch.bfloat16, torch.float16, torch.float32))
            require_shape("input_scale", scale, () if knobs.get(equivalents.SCALAR_SCALES) else (1,), "per tensor")
            require_finite("input_scale", scale)
        renamed = {CT_NAMES.get(name, name): t for name, t in tensors.items()}
        try:
            return super().dequantize(renamed, knobs)
        except FormatError as error:  # said under the names the file holds
            raise FormatError(str(error).replace("weight_packed", "weight")) from None


FORMAT = QuarkMxfp4()
