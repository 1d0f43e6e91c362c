"""A toy format and a toy engine from one file outside the package: the proof that adding either
takes one file (HARNESS_PLUGINS=tests/plugins/toy_int8.py; tests/test_plugins.py).

`toy-int8`: per-output-row symmetric int8. `weight` int8 [N, K], `weight_scale` float32 [N, 1],
W = weight * weight_scale; config `quant_method: toy-int8`. The `toy` engine is a loader written
independently of the harness's reference: it reads the safetensors itself, multiplies, and runs
the transformers model class. With TOY_ENGINE_BUG=transpose-scale it applies row i's scale to
row N-1-i instead: a deliberately buggy test double, for the proof that the harness sees it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from harness.engines import EngineEntry, register_engine
from harness.engines.base import LoadReport
from harness.engines.hf_common import HFModelEngine, checkpoint_dtype, unquantized_model
from harness.formats import register_format
from harness.formats.base import (
    Knob,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)

NAME = "toy-int8"


class ToyInt8(QuantFormat):
    name = NAME
    description = "per-row symmetric int8 (a plugin's toy format)"
    suffixes = ("weight", "weight_scale")
    marker = "weight_scale"
    knobs: Mapping[str, Knob] = {}

    def matches(self, quantization_config: Mapping[str, Any]) -> bool:
        return quantization_config.get("quant_method") == NAME

    def quantization_config(self, knobs: Mapping[str, Any], ignore: list[str]) -> dict:
        return {"quant_method": NAME, "ignore": list(ignore)}

    def knobs_from_config(self, quantization_config: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax) -> QuantizedWeight:
        w = weight.to(torch.float64)
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12).to(torch.float32)
        codes = torch.round(w / scale.double()).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight({"weight": codes, "weight_scale": scale}, truth=codes.double() * scale.double())

    def dequantize(self, tensors, knobs) -> torch.Tensor:
        codes, scale = require_tensor(tensors, "weight"), require_tensor(tensors, "weight_scale")
        require_dtype("weight", codes, (torch.int8,))
        require_shape("weight_scale", scale, (codes.shape[0], 1))
        require_finite("weight_scale", scale)
        return codes.to(torch.float64) * scale.to(torch.float64)

    def scale_block(self, knobs, shape: tuple[int, int]) -> tuple[int, int]:
        return (1, shape[1])

    def subnormal_amax(self, knobs, weight_amax: float) -> float:
        return 127 * torch.finfo(torch.float32).tiny / 4


FORMAT = ToyInt8()


class ToyEngine(HFModelEngine):
    name = "toy"

    def version(self) -> str:
        return "0.1-toy"

    def unsupported_reason(self, format_name: str) -> str | None:
        return None if format_name == NAME else f"the toy engine reads {NAME} only"

    def load(self, directory: str) -> LoadReport:
        from safetensors.torch import load_file

        root = Path(directory)
        index = root / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else ["model.safetensors"]
        )
        stored = {name: tensor for file in files for name, tensor in load_file(str(root / file)).items()}
        dtype = checkpoint_dtype(directory)
        state = {}
        for name, tensor in stored.items():
            if name.endswith(".weight_scale"):
                continue
            scale = stored.get(name.removesuffix(".weight") + ".weight_scale")
            if scale is not None:
                if os.environ.get("TOY_ENGINE_BUG") == "transpose-scale":
                    scale = scale.flip(0)
                tensor = tensor.to(torch.float32) * scale
            state[name] = tensor.to(dtype)
        self.model, tied = unquantized_model(directory)
        result = self.model.load_state_dict(state, strict=False)
        return LoadReport(missing=sorted(set(result.missing_keys) - tied), unexpected=sorted(result.unexpected_keys))


register_format(NAME, f"{__name__}:FORMAT")
register_engine("toy", EngineEntry(f"{__name__}:ToyEngine", "transformers"))
