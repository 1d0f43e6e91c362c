"""`ct-nvfp4` / `ct-nvfp4a16`: compressed-tensors `nvfp4-pack-quantized` (W4A4 / W4A16).

Tensors: `weight_packed` uint8 [N, K/2] (E2M1 codes, even column in the low nibble),
`weight_scale` float8_e4m3fn [N, K/16], `weight_global_scale` float32 [1], a DIVISOR
(2688/amax): W = e2m1 * weight_scale / weight_global_scale. W4A4 adds `input_global_scale`
float32 [1], the same divisor for activations. AutoRound's own config over these tensors
(`packing_format: auto_round:llm_compressor`, harness.formats.auto_round) is read as the same.
K must be a multiple of 16 (ct refuses otherwise, so does our quantizer). Scales follow llm-compressor's min-max observer feeding
compressed-tensors' `generate_gparam` / `calculate_qparams`, in the model's dtype, then
ct's compressor (see `quantize_ct`).
"""

from __future__ import annotations

import torch

from harness.core.numerics import E2M1_MAX, E4M3_MAX, encode_e2m1, pack_e2m1
from harness.formats import equivalents
from harness.formats import nvfp4_common as nv
from harness.formats.base import FormatError, Knob, QuantFormat, QuantizedWeight

FORMAT_NAME = "nvfp4-pack-quantized"
#: compressed-tensors' epsilon for a group scale that rounds to 0 in e4m3
ZERO_SCALE_EPS = 0.125


def ct_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """`generate_gparam`: 2688/amax computed in amax's dtype (bf16 for a bf16 model), 1.0 where
    that overflows, stored float32 [1]."""
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    scale = nv.FULL_RANGE / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def ct_group_scale(group_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """`calculate_qparams`: amax/6 in the model dtype, times the global scale in float32, clamped
    and rounded to e4m3; a scale that rounds to 0 becomes 0.125."""
    scale = group_amax / torch.tensor(E2M1_MAX, dtype=group_amax.dtype)
    scale = global_scale * scale
    scale = scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(scale.dtype)
    return torch.where(scale == 0, torch.tensor(ZERO_SCALE_EPS, dtype=scale.dtype), scale)


def quantize_ct(observed: torch.Tensor, global_scale: torch.Tensor):
    """ct's compressor: x / (scale / global_scale) in float32, clamp to +-6, round to E2M1."""
    group_amax = nv.groups(observed).abs().amax(dim=-1)
    scale = ct_group_scale(group_amax, global_scale)
    # the module parameter holding the scale has the model's dtype; e4m3 values survive it
    effective = scale.to(observed.dtype) / global_scale
    scaled = (nv.groups(observed) / effective.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return encode_e2m1(scaled.reshape(observed.shape)), scale.to(torch.float8_e4m3fn)


def ct_args(activations: bool) -> dict:
    """QuantizationArgs as ct 0.20 dumps them into config.json."""
    args = {
        "dynamic": False,
        "group_size": nv.GROUP,
        "num_bits": 4,
        "scale_dtype": "torch.float8_e4m3fn",
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
    }
    if activations:
        args.update(dynamic="local", observer="static_minmax")
    return args


class CtNvfp4(QuantFormat):
    marker = "weight_packed"
    knobs = {
        "global_scale_convention": Knob(
            "divisor",
            ("divisor", "swapped"),
            "store 1/global_scale (ModelOpt's multiplier) in the divisor slots (a perturbation)",
        ),
    }

    def __init__(self, name: str, activations: bool):
        self.name = name
        self.activations = activations
        self.input_name = "input_global_scale" if activations else None
        self.description = (
            f"compressed-tensors NVFP4 {'W4A4' if activations else 'W4A16'} "
            "(weight_packed, e4m3 weight_scale, divisor weight_global_scale)"
        )
        self.suffixes = ("weight_packed", "weight_scale", "weight_global_scale") + (
            ("input_global_scale",) if activations else ()
        )

    def _nvfp4_groups(self, quantization_config):
        # a foreign config over ct's tensors (AutoRound's) reads as the ct config it is equivalent to
        quantization_config = equivalents.read_as(quantization_config)
        if quantization_config.get("quant_method") != "compressed-tensors":
            return None
        found = []
        for group in (quantization_config.get("config_groups") or {}).values():
            if not isinstance(group, dict):
                continue
            fmt = group.get("format") or quantization_config.get("format")
            weights = group.get("weights") or {}
            if fmt == FORMAT_NAME or (  # a group that names no format, by its weights
                fmt is None
                and weights.get("num_bits") == 4
                and weights.get("type") == "float"
                and weights.get("group_size") == nv.GROUP
            ):
                found.append(group)
            elif weights:  # a group of another scheme: a mixed checkpoint (mixed), not NVFP4's
                return None
        return found or None

    def matches(self, quantization_config):
        found = self._nvfp4_groups(quantization_config)
        if not found:
            return False
        has_inputs = any(group.get("input_activations") for group in found)
        return has_inputs == self.activations

    def quantization_config(self, knobs, ignore):
        group = {
            "format": FORMAT_NAME,
            "input_activations": ct_args(True) if self.activations else None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": ct_args(False),
        }
        return {
            "config_groups": {"group_0": group},
            "format": FORMAT_NAME,
            "global_compression_ratio": None,
            "ignore": list(ignore),
            "kv_cache_scheme": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
        }

    def knobs_from_config(self, quantization_config):
        found = self._nvfp4_groups(quantization_config)
        if not found:
            raise FormatError(f"quantization_config declares no {FORMAT_NAME} group")
        for group in found:
            weights = group.get("weights") or {}
            wanted = {"num_bits": 4, "type": "float", "group_size": nv.GROUP, "strategy": "tensor_group"}
            wrong = {key: weights.get(key) for key, value in wanted.items() if weights.get(key) != value}
            if wrong:
                raise FormatError(f"NVFP4 weights need {wanted}, config has {wrong}")
        # the config names the convention: ct's global scales are divisors
        return {"global_scale_convention": "divisor"}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        observed = nv.observe(weight, model_dtype)
        global_scale = ct_global_scale(observed.abs().amax())
        codes, scale = quantize_ct(observed, global_scale)
        tensors = {"weight_packed": pack_e2m1(codes), "weight_scale": scale, "weight_global_scale": global_scale}
        if self.activations:
            tensors["input_global_scale"] = ct_global_scale(torch.tensor(activation_amax, dtype=model_dtype))
        result = QuantizedWeight(tensors, truth=nv.truth_from_codes(codes, scale, global_scale, nv.DIVIDE))
        if knobs["global_scale_convention"] == "swapped":
            nv.swap_per_tensor(result, "weight_global_scale", self.input_name, "ModelOpt's amax/2688")
        return result

    def dequantize(self, tensors, knobs):
        return nv.dequantize_nvfp4(
            tensors, "weight_packed", "weight_scale", "weight_global_scale", nv.DIVIDE, self.input_name
        )

    def scale_block(self, knobs, shape):
        return 1, nv.GROUP

    def subnormal_amax(self, knobs, weight_amax):
        return nv.subnormal_group_amax(weight_amax)


W4A4 = CtNvfp4("ct-nvfp4", activations=True)
W4A16 = CtNvfp4("ct-nvfp4a16", activations=False)
