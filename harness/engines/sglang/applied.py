"""What a Linear applies after SGLang's `process_weights_after_loading`, decoded back to [out, in]
weights by the checkpoint format's own reference (`fmt.dequantize_held`) once SGLang's layout
changes are undone: an FP8 weight its method transposed to [in, out] for the kernel, NVFP4 group
scales swizzled into 128 x 4 tiles (`sglang.srt.layers.quantization.utils.swizzle_blockscale`).
Per-part scales SGLang reduced to one (the per-tensor FP8 max scale it requantizes to, NVFP4's
largest global scale) are decoded as held: one scale for every row. A layout not read here (a
kernel's shuffled tiles) is None, and the weights placed before processing stand."""

from __future__ import annotations

import torch

#: NVFP4: one E4M3 scale per 16 columns; SGLang swizzles them in tiles of 128 rows x 4 scales
NVFP4_GROUP, TILE_ROWS, TILE_COLUMNS = 16, 128, 4


def unswizzled(scale: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Undo swizzle_blockscale: [rows padded to 128, columns padded to 4] tiles back to [rows, columns]."""
    padded_rows, padded_columns = -(-rows // TILE_ROWS) * TILE_ROWS, -(-columns // TILE_COLUMNS) * TILE_COLUMNS
    tiles = scale.reshape(1, padded_rows // TILE_ROWS, padded_columns // TILE_COLUMNS, 32, 4, TILE_COLUMNS)
    return tiles.permute(0, 1, 4, 3, 2, 5).reshape(padded_rows, padded_columns)[:rows, :columns].contiguous()


def held_as_placed(processed: dict[str, torch.Tensor], placed: dict[str, torch.Tensor]) -> dict | None:
    """The processed tensors of one Linear in the layout its placed tensors had (None where a
    layout is not read here): a transposed weight turned back, swizzled group scales unswizzled,
    anything else as held."""
    result = {}
    for suffix, tensor in processed.items():
        before = placed.get(suffix)
        if before is None or tensor.dim() != 2 or before.dim() != 2:
            result[suffix] = tensor
        elif suffix == "weight_scale" and tensor.dtype == torch.float8_e4m3fn and _swizzled(tensor, before):
            result[suffix] = unswizzled(tensor, *before.shape)
        elif tensor.t().shape == before.shape and tensor.t().is_contiguous() and not tensor.is_contiguous():
            result[suffix] = tensor.t().contiguous()  # `Parameter(weight.t())`: the kernel's [in, out] view
        elif tensor.shape == before.shape:
            result[suffix] = tensor
        else:
            return None
    return result


def _swizzled(tensor: torch.Tensor, before: torch.Tensor) -> bool:
    """NVFP4 group scales in swizzle_blockscale's padded shape, and not the placed bytes as they were
    (where swizzling moved nothing, either reading gives the same scales)."""
    rows, columns = before.shape
    padded = (-(-rows // TILE_ROWS) * TILE_ROWS, -(-columns // TILE_COLUMNS) * TILE_COLUMNS)
    if tuple(tensor.shape) != padded:
        return False
    return tensor.shape != before.shape or not torch.equal(tensor.view(torch.uint8), before.view(torch.uint8))


def applied_weight(processed: dict[str, torch.Tensor], placed: dict[str, torch.Tensor], fmt, knobs):
    """float64 [out, in]: what the processed Linear applies, by the format's reference; None where
    its layout is not read here or it holds no packed weight."""
    held = held_as_placed(processed, placed)
    if held is None or fmt is None:
        return None
    wanted = {suffix: tensor for suffix, tensor in held.items() if suffix in fmt.suffixes}
    try:
        return fmt.dequantize_held(wanted, knobs).to(torch.float64)
    except (KeyError, RuntimeError, ValueError):
        return None
