"""`modelopt-nvfp4`: NVIDIA ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4`).
Its weight-only export (`quant_algo: W4A16_NVFP4`: the same tensors without `input_scale`, measured
on ModelOpt 0.47's, cases/producers/modelopt/w4a16_nvfp4) is read too, not generated.

Tensors: `weight` uint8 [N, K/2] (E2M1 codes, even column in the low nibble),
`weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` float32 scalar [], a MULTIPLIER
(amax/2688): W = e2m1 * weight_scale * weight_scale_2; `input_scale` float32 scalar [], the
activation multiplier amax/2688. compressed-tensors' ModelOpt converter maps these to its
divisors as 1/weight_scale_2 and 1/input_scale. K must be a multiple of 16. Scales follow
ModelOpt's `NVFP4QTensor` (see `quantize_modelopt`).
"""

from __future__ import annotations

import torch

from harness.core.numerics import E2M1_MAX, E4M3_MAX, encode_e2m1, pack_e2m1
from harness.formats import equivalents
from harness.formats import nvfp4_common as nv
from harness.formats.base import FormatError, Knob, QuantFormat, QuantizedWeight

QUANT_ALGO = "NVFP4"
#: its weight-only variant: the same tensors without `input_scale`, inputs unquantized (read, not generated)
WEIGHT_ONLY_ALGO = "W4A16_NVFP4"
#: the reading knob a W4A16_NVFP4 config sets
WEIGHT_ONLY = "weight_only"


def quantize_modelopt(observed: torch.Tensor):
    """NVFP4QTensor: scale_2 = amax/2688 in float32; block scale = block_amax / (6 * scale_2),
    0 -> 1.0, clamped to [2**-9, 448], cast to e4m3; codes = round(w / (scale * scale_2))."""
    amax = observed.abs().amax().float()
    if amax == 0:
        raise FormatError(
            "ModelOpt cannot quantize an all-zero weight: weight_scale_2 = 0 makes every block scale 0/0 = NaN"
        )
    scale_2 = amax / nv.FULL_RANGE
    block_scale = nv.groups(observed).abs().amax(dim=-1).float() / (E2M1_MAX * scale_2)
    block_scale[block_scale == 0] = 1.0
    block_scale = block_scale.clamp(min=2.0**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = nv.groups(observed) / (block_scale.to(torch.float32) * scale_2).unsqueeze(-1)
    return encode_e2m1(scaled.reshape(observed.shape)), block_scale, scale_2


#: quant_algo from config.json's flat form or hf_quant_config.json's nested `quantization`
quant_algo = equivalents.modelopt_quant_algo


class ModeloptNvfp4(QuantFormat):
    name = "modelopt-nvfp4"
    description = "NVIDIA ModelOpt NVFP4 (uint8 weight, e4m3 weight_scale, multiplier weight_scale_2)"
    suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    marker = "weight_scale_2"
    knobs = {
        "global_scale_convention": Knob(
            "multiplier",
            ("multiplier", "swapped"),
            "store 1/scale (compressed-tensors' divisor) in weight_scale_2 and input_scale (a perturbation)",
        ),
        "producer_version": Knob("0.39.0", help="ModelOpt version named in quantization_config.producer"),
    }

    def matches(self, quantization_config):
        algo = quant_algo(quantization_config)
        return equivalents.from_modelopt(quantization_config) and algo in (QUANT_ALGO, WEIGHT_ONLY_ALGO)

    def quantization_config(self, knobs, ignore):
        """What ModelOpt's `convert_hf_quant_config_format` writes into config.json; vLLM reads
        `quant_algo`, `ignore` (its exclude list) and `group_size` (absent: 16) from it."""
        args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": nv.GROUP}
        group = {"input_activations": dict(args), "weights": dict(args), "targets": ["Linear"]}
        return {
            "config_groups": {"group_0": group},
            "ignore": list(ignore),
            "quant_algo": QUANT_ALGO,
            "producer": {"name": "modelopt", "version": knobs["producer_version"]},
            "quant_method": "modelopt",
        }

    def knobs_from_config(self, quantization_config):
        algo = quant_algo(quantization_config)
        if algo not in (QUANT_ALGO, WEIGHT_ONLY_ALGO):
            raise FormatError(f"quant_algo {algo!r} is not {QUANT_ALGO} or {WEIGHT_ONLY_ALGO}")
        nested = quantization_config.get("quantization")
        sizes = {nested.get("group_size")} if isinstance(nested, dict) else {quantization_config.get("group_size")}
        for group in (quantization_config.get("config_groups") or {}).values():
            if isinstance(group, dict):
                sizes |= {(group.get(part) or {}).get("group_size") for part in ("weights", "input_activations")}
        sizes.discard(None)
        if sizes - {nv.GROUP}:
            raise FormatError(f"NVFP4 group_size must be {nv.GROUP}, config has {sorted(sizes)}")
        # the config names the convention: ModelOpt's per-tensor scales are multipliers
        knobs = {"global_scale_convention": "multiplier"}
        return knobs | {WEIGHT_ONLY: True} if algo == WEIGHT_ONLY_ALGO else knobs

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        observed = nv.observe(weight, model_dtype)
        codes, block_scale, scale_2 = quantize_modelopt(observed)
        if not activation_amax > 0:
            raise FormatError(f"activation amax {activation_amax!r}: ModelOpt requires a positive input_scale")
        input_scale = torch.tensor(activation_amax, dtype=model_dtype).float() / nv.FULL_RANGE
        tensors = {
            "weight": pack_e2m1(codes),
            "weight_scale": block_scale,
            "weight_scale_2": scale_2,
            "input_scale": input_scale,
        }
        result = QuantizedWeight(tensors, truth=nv.truth_from_codes(codes, block_scale, scale_2, nv.MULTIPLY))
        if knobs["global_scale_convention"] == "swapped":
            nv.swap_per_tensor(result, "weight_scale_2", "input_scale", "compressed-tensors' 2688/amax")
        if knobs.get(WEIGHT_ONLY):  # W4A16_NVFP4 (read, not generated): what its export leaves out
            del result.tensors["input_scale"]
        return result

    def dequantize(self, tensors, knobs):
        inputs = None if knobs.get(WEIGHT_ONLY) else "input_scale"
        return nv.dequantize_nvfp4(tensors, "weight", "weight_scale", "weight_scale_2", nv.MULTIPLY, inputs)

    def scale_block(self, knobs, shape):
        return 1, nv.GROUP

    def subnormal_amax(self, knobs, weight_amax):
        return nv.subnormal_group_amax(weight_amax)


FORMAT = ModeloptNvfp4()
