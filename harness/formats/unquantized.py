"""`unquantized`: a checkpoint without `quantization_config`, every weight stored in the model dtype
as it is (a model's bf16/fp16/fp32 release).

Two things make it a format of a quantization harness: it is what online quantization starts
from (vLLM's `LLM(quantization="fp8_per_channel")` quantizes it while loading; the reference's
model of that is harness.oracle.online), and every engine's plain loading path (shards, biases,
tied embeddings, VLM key prefixes) runs on it without a quantization method in the way. Its
definition: the stored tensor is the weight. A weight stored in a quantized dtype (FP8, an
integer) without a config that says how to read it is malformed: refused, never read by value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from harness.formats.base import FormatError, QuantFormat, QuantizedWeight, require_tensor

#: the dtypes a stored weight of a model may have
MODEL_STORAGE = (torch.bfloat16, torch.float16, torch.float32)


class Unquantized(QuantFormat):
    name = "unquantized"
    description = (
        "no quantization_config: every weight stored as it is in the model dtype (online quantization's input)"
    )
    suffixes = ("weight",)
    marker = ""  # no module is marked quantized: group_modules finds only weights stored quantized
    #: no scales, no quantization config: the layouts and perturbations of scales do not apply
    #: (harness.checkpoints.recipe.layout_refusal, perturb_refusal)
    has_scales = False

    def matches(self, quantization_config: Mapping[str, Any]) -> bool:
        return not quantization_config

    def quantization_config(self, knobs: Mapping[str, Any], ignore: list[str]) -> None:
        """None: config.json gets no `quantization_config` key at all."""
        return None

    def knobs_from_config(self, quantization_config: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax) -> QuantizedWeight:
        stored = weight.to(model_dtype)
        return QuantizedWeight({"weight": stored}, truth=stored.to(torch.float64))

    def dequantize(self, tensors: Mapping[str, torch.Tensor], knobs: Mapping[str, Any]) -> torch.Tensor:
        """The stored weight, in float64; one stored in a quantized dtype is refused (its config,
        which would say how to read it, is missing)."""
        weight = require_tensor(tensors, "weight")
        if weight.dtype not in MODEL_STORAGE:
            raise FormatError(
                f"weight stored as {str(weight.dtype).removeprefix('torch.')}, but config.json has no "
                "quantization_config to say how to read it (an unquantized checkpoint stores weights in "
                "bfloat16, float16 or float32)"
            )
        return weight.to(torch.float64)

    def scale_block(self, knobs: Mapping[str, Any], shape: tuple[int, int]) -> tuple[int, int]:
        """No scales: a row is the region a finding is localised to."""
        return (1, shape[1])

    def subnormal_amax(self, knobs: Mapping[str, Any], weight_amax: float) -> float:
        raise FormatError("an unquantized weight has no scale to make subnormal")


FORMAT = Unquantized()
