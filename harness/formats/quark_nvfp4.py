"""`quark-nvfp4` (read, not written): AMD Quark's NVFP4 export (`quant_method: quark`, its `nvfp4`
scheme; harness.formats.quark.is_nvfp4 says which configs).

ModelOpt's NVFP4 tensors under Quark's names (measured on amd-quark 0.13's own export,
cases/producers/quark/nvfp4): `weight` uint8 [N, K/2] (E2M1 codes, even column in the low nibble),
`weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` float32 [] a MULTIPLIER (amax / 2688, one per
Linear, not shared across fused parts): W = e2m1 * weight_scale * weight_scale_2; `input_scale_2`
float32 [] the activation's multiplier (amax / 2688), absent where the scheme quantizes weights only.
"""

from __future__ import annotations

from harness.formats import nvfp4_common as nv
from harness.formats import quark
from harness.formats.base import FormatError
from harness.formats.modelopt_nvfp4 import FORMAT as MODELOPT_NVFP4
from harness.formats.modelopt_nvfp4 import WEIGHT_ONLY, ModeloptNvfp4

INPUT_SCALE = "input_scale_2"


class QuarkNvfp4(ModeloptNvfp4):
    name = "quark-nvfp4"
    description = "AMD Quark NVFP4 (uint8 weight, e4m3 weight_scale, multipliers weight_scale_2 and input_scale_2)"
    suffixes = ("weight", "weight_scale", "weight_scale_2", INPUT_SCALE)
    marker = "weight_scale_2"
    knobs = {}

    def matches(self, quantization_config):
        return quark.is_nvfp4(quantization_config)

    def quantization_config(self, knobs, ignore):
        return quark.fragment(ignore)

    def knobs_from_config(self, quantization_config):
        if not quark.is_nvfp4(quantization_config):
            raise FormatError("quantization_config is not Quark's NVFP4 scheme")
        scheme = quantization_config["global_quant_config"]
        knobs = {"global_scale_convention": "multiplier"}  # Quark's per-tensor scales are multipliers
        return knobs | {WEIGHT_ONLY: True} if scheme.get("input_tensors") is None else knobs

    def schemes(self, knobs):
        # what an engine needs a kernel for is asked of a format it can be shown (a capability probe
        # writes a checkpoint of it): ModelOpt's NVFP4, these tensors under their first names
        return (MODELOPT_NVFP4,)

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        """ModelOpt's NVFP4 quantization under Quark's names: the tensors this format stores, their
        dtypes and shapes (the audit's model of a module); no generator writes this format."""
        result = super().quantize(weight, knobs, model_dtype=model_dtype, activation_amax=activation_amax)
        if "input_scale" in result.tensors:
            result.tensors[INPUT_SCALE] = result.tensors.pop("input_scale")
        return result

    def dequantize(self, tensors, knobs):
        inputs = None if knobs.get(WEIGHT_ONLY) else INPUT_SCALE
        return nv.dequantize_nvfp4(tensors, "weight", "weight_scale", "weight_scale_2", nv.MULTIPLY, inputs)


FORMAT = QuarkNvfp4()
