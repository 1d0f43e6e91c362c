"""`ct-fp8-*`: compressed-tensors `float-quantized` FP8 (W8A8 FP8, FP8_DYNAMIC, FP8_BLOCK).

Tensors: `weight` float8_e4m3fn [N, K] and `weight_scale` in the model dtype, shaped [1]
(tensor), [N, 1] (channel) or [ceil(N/bn), ceil(K/bk)] (block, edge blocks partial);
W = w * weight_scale. A static-activation scheme adds `input_scale` [1]. Config:
`quant_method: compressed-tensors`, `format: float-quantized`, one config group whose
`weights` give the strategy (and `block_structure` [bn, bk]).

Scales follow compressed-tensors 0.20 (`calculate_qparams`, `quantize`), every step in the
scale dtype: scale = amax / 448, a zero scale replaced by finfo(dtype).eps;
q = e4m3(clamp(w / scale, +-448)).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from harness.core.numerics import E4M3_MAX, encode_e4m3
from harness.formats import equivalents
from harness.formats.base import (
    FormatError,
    Knob,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)
from harness.formats.fp8_block import (
    block_amax,
    block_truth,
    dequantize_fp8_blocks,
    expand_block_grid,
    transpose_scale_grid,
)

#: the compressed-tensors release whose `ModelCompressor.update_config` output we reproduce
CT_VERSION = "0.20.0"
SCALE_DTYPES = ("model", "float32")

# activation args exactly as ct serializes its presets (FP8, FP8_DYNAMIC, FP8_BLOCK)
STATIC_TENSOR_INPUT = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "tensor",
    "dynamic": False,
    "observer": "static_minmax",
}
DYNAMIC_TOKEN_INPUT = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "token",
    "dynamic": True,
}
DYNAMIC_GROUP_INPUT = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": 128,
    "strategy": "group",
    "dynamic": True,
}


def _grid_from_4d(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """ModelOpt's block grid [N/bn, 1, K/bk, 1] (its one-block dimensions squeezed: [] for a single
    block, [N/bn, 1, 1, 1] for one column of blocks) as the [N/bn, K/bk] grid."""
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if scale.dim() > 4 or [d for d in scale.shape if d != 1] != [d for d in grid if d != 1]:
        raise FormatError(
            f"weight_scale has shape {list(scale.shape)}; weight [{rows}, {cols}] in blocks {list(block)} needs the "
            f"grid {list(grid)}, stored as ModelOpt stores it ([{grid[0]}, 1, {grid[1]}, 1], one-block dimensions squeezed)"
        )
    return scale.reshape(grid)


def per_tensor_shape(knobs: Mapping[str, Any]) -> tuple[int, ...]:
    """How a per-tensor scale is stored: [1], or 0-D where the config was Quark's (SCALAR_SCALES)."""
    return () if knobs.get(equivalents.SCALAR_SCALES) else (1,)


def scale_dtype_for(knobs: Mapping[str, Any], model_dtype: torch.dtype) -> torch.dtype:
    """ct stores qparams in the dtype of the observed weight (float16 for non-float models)."""
    if knobs["scale_dtype"] == "float32":
        return torch.float32
    return (
        model_dtype if model_dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else torch.float16
    )


def ct_scale(amax: torch.Tensor) -> torch.Tensor:
    """ct's symmetric FP8 scale: amax / (896 / 2) in amax's dtype; 0 -> finfo(dtype).eps.

    The eps keeps all-zero regions from dividing by zero; they quantize to (signed) zeros.
    """
    scale = amax / torch.tensor(E4M3_MAX, dtype=amax.dtype)
    return torch.where(scale == 0, torch.tensor(torch.finfo(amax.dtype).eps, dtype=amax.dtype), scale)


def config_group(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The single config group of a compressed-tensors float-quantized FP8 config (or of a foreign
    config over these tensors, harness.formats.equivalents), else None."""
    config = equivalents.read_as(config)
    if config.get("quant_method") != "compressed-tensors":
        return None
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        return None
    group = next(iter(groups.values()))
    if not isinstance(group, Mapping) or (group.get("format") or config.get("format")) != "float-quantized":
        return None
    weights = group.get("weights")
    if not isinstance(weights, Mapping) or weights.get("type") != "float" or weights.get("num_bits") != 8:
        return None
    return group


class CtFp8(QuantFormat):
    """One weight strategy of ct's float-quantized format; the three instances differ only here."""

    suffixes = ("weight", "weight_scale", "input_scale")
    marker = "weight_scale"

    def __init__(self, strategy: str, description: str):
        self.strategy = strategy
        self.name = f"ct-fp8-{strategy}"
        self.description = description
        self.knobs = {
            "scale_dtype": Knob("model", SCALE_DTYPES, "dtype of weight_scale/input_scale"),
            "input_scale": Knob(False, (False, True), "declare static per-tensor input activations"),
        }
        if strategy == "block":
            self.knobs |= {
                "block_rows": Knob(128, help="block height bn"),
                "block_cols": Knob(128, help="block width bk"),
                "scale_layout": Knob("normal", ("normal", "transposed"), "store the grid transposed (a perturbation)"),
            }

    def resolve_knobs(self, overrides):
        overrides = dict(overrides)
        if self.strategy == "block" and "block_size" in overrides:
            size = overrides.pop("block_size")
            overrides.setdefault("block_rows", size)
            overrides.setdefault("block_cols", size)
        return super().resolve_knobs(overrides)

    def matches(self, quantization_config):
        group = config_group(quantization_config)
        return group is not None and group["weights"].get("strategy") == self.strategy

    def quantization_config(self, knobs, ignore):
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "group_size": None,
            "strategy": self.strategy,
            "dynamic": False,
        }
        if self.strategy == "block":
            weights["block_structure"] = [knobs["block_rows"], knobs["block_cols"]]
        if knobs["input_scale"]:
            inputs = STATIC_TENSOR_INPUT
        else:
            inputs = DYNAMIC_GROUP_INPUT if self.strategy == "block" else DYNAMIC_TOKEN_INPUT
        group = {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": dict(inputs),
            "output_activations": None,
            "format": "float-quantized",
        }
        return {
            "version": CT_VERSION,
            "quant_method": "compressed-tensors",
            "sparsity_config": {},
            "transform_config": {},
            "config_groups": {"group_0": group},
            "kv_cache_scheme": None,
            "format": "float-quantized",
            "quantization_status": "compressed",
            "global_compression_ratio": None,
            "ignore": list(ignore),
            "moe_sparsity_config": None,
        }

    def knobs_from_config(self, quantization_config):
        translated = equivalents.equivalent_config(quantization_config)  # a foreign config, read once
        group = config_group(translated or quantization_config)
        if group is None or group["weights"].get("strategy") != self.strategy:
            raise FormatError(f"quantization_config is not compressed-tensors float-quantized {self.strategy} FP8")
        inputs = group.get("input_activations") or {}
        knobs = {"input_scale": inputs.get("dynamic") is False}
        if self.strategy == "channel" and translated:
            knobs[equivalents.ROW_SCALES_1D] = True  # AutoRound's and ModelOpt's [N] row scales
        if self.strategy == "tensor" and translated:
            knobs[equivalents.SCALAR_SCALES] = True  # Quark's 0-D scales
        if self.strategy == "block" and translated:
            knobs[equivalents.BLOCK_GRID_4D] = True  # ModelOpt's [N/bn, 1, K/bk, 1], squeezed
        if self.strategy == "block":
            structure = group["weights"].get("block_structure")
            if not (
                isinstance(structure, list)
                and len(structure) == 2
                and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in structure)
            ):
                raise FormatError(f"block_structure {structure!r} is not [rows, cols] of positive ints")
            knobs |= {"block_rows": structure[0], "block_cols": structure[1]}
        return knobs

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        dtype = scale_dtype_for(knobs, model_dtype)
        # ct quantizes the module's weight, which lives in the model dtype
        weight = weight.to(model_dtype)
        block = self.scale_block(knobs, tuple(weight.shape))
        # block_amax (float32) is exact for 16/32-bit model dtypes: a max of their values
        scale = ct_scale(block_amax(weight, block).to(dtype))
        quantized = encode_e4m3(weight / expand_block_grid(scale, *weight.shape, block))
        stored = scale.reshape(1) if self.strategy == "tensor" else scale
        result = QuantizedWeight(
            {"weight": quantized, "weight_scale": stored}, truth=block_truth(quantized, scale, block)
        )
        if knobs["input_scale"]:
            amax = torch.tensor(float(activation_amax), dtype=model_dtype).abs().to(dtype)
            result.tensors["input_scale"] = ct_scale(amax).reshape(1)
        if dtype != model_dtype:
            result.notes.append(
                f"scales stored as {str(dtype).removeprefix('torch.')}, not the model dtype: "
                "a loader that casts them to the model dtype first rounds twice"
            )
        if self.strategy == "block" and knobs["scale_layout"] == "transposed":
            transpose_scale_grid(result, "weight_scale", block)
        return result

    def scale_grid(self, tensors, knobs) -> torch.Tensor:
        """`weight_scale` as the grid of scale blocks over the weight (scale_block), in its stored
        dtype: [1, 1] per tensor, [rows, 1] per channel, ModelOpt's 4-D block grid squeezed."""
        weight = require_tensor(tensors, "weight")
        scale = require_tensor(tensors, "weight_scale")
        require_dtype("weight", weight, (torch.float8_e4m3fn,))
        if weight.dim() != 2:
            raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
        rows, cols = weight.shape
        if self.strategy == "tensor":
            require_shape("weight_scale", scale, per_tensor_shape(knobs), "per-tensor scale")
            return scale.reshape(1, 1)
        if self.strategy == "channel" and knobs.get(equivalents.ROW_SCALES_1D):
            require_shape("weight_scale", scale, (rows,), "one scale per output row, stored 1-D (AutoRound, ModelOpt)")
            return scale.reshape(rows, 1)
        if self.strategy == "channel":
            require_shape("weight_scale", scale, (rows, 1), "one scale per output row")
        elif self.strategy == "block" and knobs.get(equivalents.BLOCK_GRID_4D):
            return _grid_from_4d(scale, self.scale_block(knobs, (rows, cols)), rows, cols)
        return scale

    def dequantize(self, tensors, knobs):
        scale = self.scale_grid(tensors, knobs)
        weight = tensors["weight"]
        rows, cols = weight.shape
        if knobs.get("input_scale"):
            input_scale = require_tensor(tensors, "input_scale")
            require_dtype("input_scale", input_scale, (torch.float32, torch.bfloat16, torch.float16))
            require_shape("input_scale", input_scale, per_tensor_shape(knobs), "static per-tensor activation scale")
            require_finite("input_scale", input_scale)
        return dequantize_fp8_blocks(weight, scale, self.scale_block(knobs, (rows, cols)), "weight_scale")

    def scale_block(self, knobs, shape):
        if self.strategy == "tensor":
            return tuple(shape)
        if self.strategy == "channel":
            return 1, shape[1]
        return knobs["block_rows"], knobs["block_cols"]

    def subnormal_amax(self, knobs, weight_amax):
        # scale = amax / 448 = 2**-130: subnormal in bfloat16 and float32 (normal down to
        # 2**-126). A float16 model's scale would underflow to 0 and become eps instead.
        return 448.0 * 2.0**-130


TENSOR = CtFp8("tensor", "compressed-tensors FP8, one weight_scale per tensor (FP8 / W8A8)")
CHANNEL = CtFp8("channel", "compressed-tensors FP8, one weight_scale per output row (FP8_DYNAMIC)")
BLOCK = CtFp8("block", "compressed-tensors FP8, block-scaled weight_scale grid (FP8_BLOCK)")
