"""`fp8-block`: FineGrainedFP8 / DeepSeek-V3 block-scaled FP8.

Tensors: `weight` float8_e4m3fn [N, K] and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]
(float32 normally). Despite its name the scale is a multiplier: W = w * scale_inv per
block, edge blocks partial. Config: `quant_method: fp8`, `weight_block_size` [bn, bk]
(a scalar or one-element list means a square block), default [128, 128]. `weight_block_size: null`
(transformers' FineGrainedFP8Config(weight_block_size=None)) means one scale per weight: the block
is the whole tensor and `weight_scale_inv` is its one-block grid [1, 1] (knob `granularity`).

`scale_fmt: ue8m0` (DeepSeek-V3.1, transformers' FineGrainedFP8Config) declares every scale a
power of two: the quantizer rounds amax / 448 up to one, 2**ceil(log2(.)), and divides the
weights by it. The scale is then stored in float32 (DeepSeek-V3.1), typed float8_e8m0fnu
(transformers' own quantizer) or as its E8M0 bytes in uint8 (MXFP8 checkpoints); the last two
are read by their bits: byte c means 2**(c - 127).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.core.errors import HarnessError
from harness.core.numerics import E4M3_MAX, ceil_div, decode_e4m3, encode_e4m3
from harness.formats import equivalents
from harness.formats.base import (
    FormatError,
    Knob,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_tensor,
)

SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: knob `scale_fmt`: "float" (amax / 448 in scale_dtype), or power-of-two scales declared
#: `scale_fmt: ue8m0` and stored in scale_dtype ("ue8m0"), typed float8_e8m0fnu ("ue8m0-e8m0fnu")
#: or as E8M0 bytes ("ue8m0-uint8"); "ue8m0-unrounded" is a perturbation: declared ue8m0, stored
#: amax / 448 (not powers of two): a loader must use the stored values or refuse, never round them
SCALE_FMTS = ("float", "ue8m0", "ue8m0-e8m0fnu", "ue8m0-uint8", "ue8m0-unrounded")
E8M0_STORAGE = {"ue8m0-e8m0fnu": torch.float8_e8m0fnu, "ue8m0-uint8": torch.uint8}


def parse_block_size(value: Any) -> tuple[int, int]:
    """`weight_block_size` as written in the wild: [bn, bk], [b], or b (null, one scale per
    tensor, is the caller's to read: it has no block size)."""
    if isinstance(value, bool):
        raise FormatError(f"weight_block_size {value!r} is not a block size")
    if isinstance(value, int):
        sizes = [value, value]
    elif isinstance(value, (list, tuple)) and len(value) in (1, 2):
        sizes = list(value) * (2 if len(value) == 1 else 1)
    else:
        raise FormatError(f"weight_block_size {value!r} is not an int or a list of one or two ints")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise FormatError(f"weight_block_size {value!r} must hold positive integers")
    return sizes[0], sizes[1]


def expand_block_grid(grid: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Repeat a [ceil(N/bn), ceil(K/bk)] grid over [N, K], cutting the partial edge blocks.
    A block larger than the weight is one block (and must not allocate its nominal size)."""
    bn, bk = min(block[0], rows), min(block[1], cols)
    return grid.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def block_amax(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max |w| per block, edge blocks included (padding with zeros does not change a max)."""
    bn, bk = block
    rows, cols = weight.shape
    gn, gk = ceil_div(rows, bn), ceil_div(cols, bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32).abs()
    return padded.reshape(gn, bn, gk, bk).amax(dim=(1, 3))


def quantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype, power_of_two: bool = False
):
    """scale = amax/448 per block (1.0 for an all-zero block), rounded up to a power of two where
    asked (UE8M0), q = clamp(w/scale) -> e4m3."""
    amax = block_amax(weight, block)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.to(scale_dtype)
    expanded = expand_block_grid(scale.to(torch.float32), *weight.shape, block)
    quantized = encode_e4m3(weight.to(torch.float32) / expanded)
    return quantized, scale


def block_truth(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Ground truth computed independently of `dequantize`: torch's own e4m3 cast, index lookup."""
    rows, cols = quantized.shape
    row_block = torch.arange(rows) // block[0]
    col_block = torch.arange(cols) // block[1]
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        scale = decode_ue8m0("scale", scale)
    per_element = scale.to(torch.float64)[row_block][:, col_block]
    return quantized.to(torch.float64) * per_element


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], scale_name: str):
    """Reference: decode e4m3 from its bits, multiply by the block's scale."""
    require_dtype("weight", weight, (torch.float8_e4m3fn,))
    require_dtype(scale_name, scale, (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu, torch.uint8))
    if weight.dim() != 2:
        raise FormatError(f"weight has {weight.dim()} dimensions, expected 2")
    rows, cols = weight.shape
    grid = (ceil_div(rows, block[0]), ceil_div(cols, block[1]))
    if tuple(scale.shape) != grid:
        raise FormatError(
            f"{scale_name} has shape {list(scale.shape)} but weight [{rows}, {cols}] with block "
            f"{list(block)} needs the grid {list(grid)}"
        )
    scale = decode_ue8m0(scale_name, scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale
    require_finite(scale_name, scale)
    return decode_e4m3(weight) * expand_block_grid(scale.to(torch.float64), rows, cols, block)


def decode_ue8m0(name: str, scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales stored as float8_e8m0fnu or E8M0 bytes in uint8 (`scale_fmt: ue8m0`),
    decoded from their bits: code c means 2**(c - 127); 0xFF is NaN."""
    codes = scale.view(torch.uint8).to(torch.int64)
    decoded = torch.ldexp(torch.ones(codes.shape, dtype=torch.float64), codes - 127)
    return torch.where(codes == 255, torch.tensor(float("nan"), dtype=torch.float64), decoded)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two as their E8M0 bytes (2**e -> e + 127), uint8."""
    codes = torch.log2(scale.to(torch.float64)).round() + 127
    if codes.min() < 0 or codes.max() > 254:
        raise HarnessError(f"a scale of 2**{int(codes.min()) - 127} has no E8M0 code (2**-127 .. 2**127)")
    return codes.to(torch.uint8)


def transpose_scale_grid(result: QuantizedWeight, scale_name: str, block: tuple[int, int]) -> None:
    """Store a block grid transposed. A non-square grid no longer fits the weight: a correct
    loader refuses it or transposes it back. A square one cannot be told apart: the files
    then mean the definition's reading, which becomes the truth."""
    scale = result.tensors[scale_name]
    transposed = scale.t().contiguous()
    result.tensors[scale_name] = transposed
    if transposed.shape == scale.shape:
        result.truth = block_truth(result.tensors["weight"], transposed, block)
        result.notes.append(
            f"{scale_name} stored transposed; square grid, so undetectable: truth is the literal reading"
        )
    else:
        result.expectation = "exact-or-refuse"
        result.notes.append(
            f"{scale_name} stored transposed {list(transposed.shape)}: does not fit "
            "the weight; a loader must refuse it or transpose it back"
        )


class Fp8Block(QuantFormat):
    name = "fp8-block"
    description = "FineGrainedFP8 / DeepSeek block FP8 (weight_scale_inv, weight_block_size)"
    suffixes = ("weight", "weight_scale_inv")
    marker = "weight_scale_inv"
    knobs = {
        "block_rows": Knob(128, help="block height bn"),
        "block_cols": Knob(128, help="block width bk"),
        "block_size_style": Knob("list", ("list", "one-element", "scalar"), "how weight_block_size is written"),
        "scale_dtype": Knob("float32", tuple(SCALE_DTYPES), "dtype of weight_scale_inv"),
        "scale_layout": Knob("normal", ("normal", "transposed"), "store the grid transposed (a perturbation)"),
        "scale_fmt": Knob("float", SCALE_FMTS, "power-of-two (UE8M0) scales and how they are stored"),
        "granularity": Knob(
            "block", ("block", "tensor"), "one scale per block, or per weight (weight_block_size null)"
        ),
    }

    def resolve_knobs(self, overrides):
        overrides = dict(overrides)
        if "block_size" in overrides:
            size = overrides.pop("block_size")
            overrides.setdefault("block_rows", size)
            overrides.setdefault("block_cols", size)
        values = super().resolve_knobs(overrides)
        if values["block_size_style"] != "list" and values["block_rows"] != values["block_cols"]:
            raise ValueError("a scalar or one-element weight_block_size needs a square block")
        return values

    def matches(self, quantization_config):
        quantization_config = equivalents.read_as(quantization_config)
        return quantization_config.get("quant_method") == "fp8" and "weight_block_size" in quantization_config

    def probe_answers(self, knobs):
        # one scale per weight takes another kernel than the probe's blocks
        return knobs.get("granularity", "block") == "block"

    def quantization_config(self, knobs, ignore):
        rows, cols = knobs["block_rows"], knobs["block_cols"]
        block = {"list": [rows, cols], "one-element": [rows], "scalar": rows}[knobs["block_size_style"]]
        if knobs.get("granularity", "block") == "tensor":
            block = None
        config = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": block,
            "modules_to_not_convert": list(ignore),
        }
        if knobs.get("scale_fmt", "float") != "float":
            config["scale_fmt"] = "ue8m0"
        return config

    def knobs_from_config(self, quantization_config):
        # AutoRound's own auto_round:fp8 config over these tensors (harness.formats.auto_round)
        quantization_config = equivalents.read_as(quantization_config)
        scale_fmt = quantization_config.get("scale_fmt", "float")
        if scale_fmt not in ("float", "ue8m0"):
            raise FormatError(f"scale_fmt {scale_fmt!r} is not 'float' or 'ue8m0'")
        if quantization_config.get("weight_block_size") is None:
            return {"granularity": "tensor", "scale_fmt": scale_fmt}
        rows, cols = parse_block_size(quantization_config.get("weight_block_size"))
        return {"block_rows": rows, "block_cols": cols, "scale_fmt": scale_fmt}

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        block = self.scale_block(knobs, tuple(weight.shape))
        scale_fmt = knobs.get("scale_fmt", "float")
        rounded = scale_fmt not in ("float", "ue8m0-unrounded")
        quantized, scale = quantize_fp8_blocks(weight, block, SCALE_DTYPES[knobs["scale_dtype"]], rounded)
        result = QuantizedWeight(
            {"weight": quantized, "weight_scale_inv": scale}, truth=block_truth(quantized, scale, block)
        )
        if scale_fmt in E8M0_STORAGE:  # the same powers of two, stored as their E8M0 bytes
            result.tensors["weight_scale_inv"] = e8m0_bytes(scale).view(E8M0_STORAGE[scale_fmt])
        if scale_fmt == "ue8m0-unrounded":
            result.expectation = "exact-or-refuse"
            result.notes.append(
                "scale_fmt ue8m0 declared, scales stored as amax / 448 (not powers of two): "
                "use them as stored or refuse; rounding them moves every weight of the block"
            )
        if knobs["scale_layout"] == "transposed":
            transpose_scale_grid(result, "weight_scale_inv", block)
        return result

    def scale_block(self, knobs, shape):
        if knobs.get("granularity", "block") == "tensor":
            return tuple(shape)
        return knobs["block_rows"], knobs["block_cols"]

    def subnormal_amax(self, knobs, weight_amax):
        # float32 and bfloat16 share the exponent range: normal down to 2**-126; scales stored as E8M0
        # reach down to 2**-127 only (code 0), itself subnormal in float32
        return 448.0 * 2.0 ** (-127 if knobs.get("scale_fmt") in E8M0_STORAGE else -130)

    def dequantize(self, tensors, knobs):
        weight = require_tensor(tensors, "weight")
        block = self.scale_block(knobs, tuple(weight.shape))
        scale = require_tensor(tensors, "weight_scale_inv")
        if scale.dtype == torch.uint8 and knobs.get("scale_fmt", "float") == "float":
            raise FormatError("weight_scale_inv is uint8 (E8M0 bytes) but the config does not declare scale_fmt ue8m0")
        return dequantize_fp8_blocks(weight, scale, block, "weight_scale_inv")


FORMAT = Fp8Block()
