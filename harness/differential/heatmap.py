"""Per-block error heatmaps as PNG, written with the standard library only (no plotting stack).

Each cell is one scale block; colour runs from white (exact) through yellow (within
tolerance) to red (over tolerance) and black (non-finite)."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

MIN_CELL, TARGET_SIDE = 4, 256  # pixels per block side; small grids are drawn larger


def _colour(ratio: float) -> tuple[int, int, int]:
    if not math.isfinite(ratio):
        return (0, 0, 0)
    if ratio <= 0:
        return (255, 255, 255)
    if ratio <= 1:
        return (255, 255, int(255 * (1 - ratio) * 0.8))
    strength = min(1.0, math.log10(ratio) / 3)  # 1x..1000x over tolerance
    return (255 - int(90 * strength), int(200 * (1 - strength)), 0)


def write_heatmap(grid: list[list[float]], path: Path) -> Path:
    rows = len(grid)
    cols = len(grid[0]) if rows else 0
    cell = max(MIN_CELL, TARGET_SIDE // max(rows, cols, 1))
    width, height = max(cols, 1) * cell, max(rows, 1) * cell
    raw = bytearray()
    for r in range(height):
        raw.append(0)
        for c in range(width):
            value = grid[r // cell][c // cell] if rows and cols else 0.0
            edge = cell > 6 and (r % cell == 0 or c % cell == 0)
            raw.extend((200, 200, 200) if edge else _colour(value))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(bytes(raw), 9)) + chunk(b"IEND", b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    return path
