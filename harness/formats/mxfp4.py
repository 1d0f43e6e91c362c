"""`mxfp4`: gpt-oss's release format, transformers' `quant_method: mxfp4` (`Mxfp4Config`).

Only the experts are quantized, stored packed per projection (harness.checkpoints.packed_experts):
`…experts.gate_up_proj_blocks` uint8 [E, N, K/32, 16] with `…_scales` uint8 [E, N, K/32] and the
projection's bias `…_bias` [E, N] in the model dtype. Per expert and row, each 32 consecutive
columns share one E8M0 scale, and each byte holds two E2M1 codes, the even column in the low
nibble: W[n, k] = e2m1 * 2**(scale - 127), the OCP MX v1.0 definition `ct-mxfp4` also stores
(0xFF is NaN there, refused). An expert's slice is exactly a `ct-mxfp4` weight [N, K/2] + scale
[N, K/32] for a K that is a multiple of 32 (the block layout cannot hold a partial group), so
the per-expert view reuses that format's quantizer and reference dequantizer. gate_up rows
alternate gate, up, gate, ... (gpt-oss's own order); that is the architecture's business.
The `scale_storage` knob (inherited) stores `_scales` as float8_e8m0fnu instead, the same bytes
typed (F8_E8M0 on disk); the config does not change and the reference reads the bytes either way.

Config, as the release writes it: `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`
with layer wildcards (`model.layers.*.self_attn`, `model.layers.*.mlp.router`, ...). The scales
are chosen as compressed-tensors' MXFP4 observer does (OpenAI's own producer is not public): any
choice is judged the same way, by the dequantization the format defines.
"""

from __future__ import annotations

import re

from harness.formats.base import FormatError
from harness.formats.ct_mxfp4 import GROUP, CtMxfp4

QUANT_METHOD = "mxfp4"
_LAYER = re.compile(r"\.layers\.\d+\.")


def release_patterns(ignore: list[str]) -> list[str]:
    """Module names with their layer index replaced by `*`, once each, in first-seen order."""
    return list(dict.fromkeys(_LAYER.sub(".layers.*.", name) for name in ignore))


class Mxfp4(CtMxfp4):
    name = "mxfp4"
    description = "gpt-oss MXFP4 (experts packed: _blocks E2M1 pairs, _scales E8M0 per 32 columns)"

    def matches(self, quantization_config):
        return quantization_config.get("quant_method") == QUANT_METHOD

    def quantization_config(self, knobs, ignore):
        return {"modules_to_not_convert": release_patterns(ignore), "quant_method": QUANT_METHOD}

    def knobs_from_config(self, quantization_config):
        if not self.matches(quantization_config):
            raise FormatError(f"quantization_config is not quant_method {QUANT_METHOD}")
        return {}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        if weight.dim() == 2 and weight.shape[1] % GROUP:
            raise FormatError(
                f"K={weight.shape[1]} is not a multiple of {GROUP}: the packed blocks [N, K/32, 16] cannot hold it"
            )
        return super().quantize(weight, knobs, model_dtype=model_dtype, activation_amax=activation_amax)

    def dequantize(self, tensors, knobs):
        packed = tensors.get("weight_packed")
        if packed is not None and packed.dim() == 2 and (2 * packed.shape[1]) % GROUP:
            raise FormatError(f"weight_packed holds K={2 * packed.shape[1]}, not whole blocks of {GROUP} columns")
        return super().dequantize(tensors, knobs)


FORMAT = Mxfp4()
