"""A fast dequantizer beside the oracle: float32 or bfloat16, row tile by row tile into
preallocated memory, every result checked against the float64 reference on sampled tiles.

The reference (`fmt.dequantize`) stays the definition; this path only computes the same values
faster, and says so at run time by recomputing a few tiles of every tensor with the reference.

Refusals are the reference's own: `run_reference_checks` calls `fmt.dequantize` with the packed
weight replaced by a stand-in that has its shape and dtype but stops the reference at the first
use of its values, so every check the reference makes runs, on the real scales, and none of its
arithmetic does (the reference checks before it computes; tests/oracle/test_fast.py holds the
fast path to its refusals word for word).

Exactness (asserted bit for bit, NaN where the reference has NaN):
- FP8 (`fp8-block`, `ct-fp8-*`, `modelopt-fp8`, `autofp8`): code (4 significant bits) x scale (float32,
  bfloat16 or float16, all exact in float32) is exact in float64, so the reference holds the exact
  product; one float32 multiply rounds it once to nearest-even: float32 output == `reference.to(float32)`.
- int4/int8 (`ct-int4`, `ct-int8`): code minus zero point (an integer in [-255, 255], at most 8
  significant bits, exact in float32) x group scale (float32, bfloat16 or float16: at most 24
  significant bits) is exact in float64 as well; the same single float32 multiply, the same equality.
- NVFP4: e2m1 x e4m3 scale (at most 6 significant bits) is exact in float32; the per-tensor scale
  is then applied by one float32 division (compressed-tensors) or multiplication (ModelOpt). The
  reference rounds the quotient to float64 first, but rounding to 53 bits and then to 24 equals
  rounding to 24 once for a quotient of two floats (53 >= 2 * 24 + 2), and the product is exact in
  float64: float32 output == `reference.to(float32)` again. These values come from a per-tensor
  table of all 256 x 16 (scale code, e2m1 code) results, computed with those same float32 ops.
- MXFP4 (`ct-mxfp4`): e2m1 x 2**(e8m0 - 127) is a power-of-two multiple of a value with at most 2
  significant bits, exact in float32 from 2**-128 up (the smallest, 0.5 x 2**-127) and infinite in
  float32 exactly where the float64 product exceeds float32's range: a table of all 256 x 16
  (scale code, e2m1 code) products, looked up per packed byte, == `reference.to(float32)`.
- bfloat16 output is that float32 result rounded to nearest-even bfloat16:
  == `reference.to(float32).to(bfloat16)`, which is also what torch's `reference.to(bfloat16)`
  gives (torch converts float64 to bfloat16 through float32). That is a double rounding: where the
  float32 result lies exactly halfway between two bfloat16 values it can differ by one bfloat16
  ulp from the float64 value rounded once (tests/oracle/test_fast.py builds one such element;
  benchmarks/bench_fast_dequant.py counts them in a real-size weight).
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.checkpoints.reader import Checkpoint
from harness.core.errors import CheckpointError, HarnessError
from harness.core.numerics import E2M1_TABLE, E4M3_TABLE, NVFP4_GROUP, ceil_div
from harness.formats import nvfp4_common as nv
from harness.formats.autofp8 import AutoFp8
from harness.formats.base import FormatError, QuantFormat
from harness.formats.ct_fp8 import CtFp8
from harness.formats.ct_int4 import CtPackQuantized, read_weight_shape
from harness.formats.ct_int_groups import CtIntGroups, require_int4_codes
from harness.formats.ct_mxfp4 import E8M0_BIAS, CtMxfp4
from harness.formats.ct_mxfp4 import GROUP as MXFP4_GROUP
from harness.formats.ct_mxfp8 import CtMxfp8
from harness.formats.ct_nvfp4 import CtNvfp4
from harness.formats.ct_w8a8 import CtW8a8
from harness.formats.fp8_block import Fp8Block, decode_ue8m0
from harness.formats.int_packing import pack, packed_extent, unpack
from harness.formats.modelopt_fp8 import ModeloptFp8
from harness.formats.modelopt_nvfp4 import ModeloptNvfp4
from harness.formats.quark_int8 import QuarkInt8
from harness.oracle.reference import format_and_knobs, group_modules

OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: output elements per row tile (2 MiB of float32): large enough that the per-op cost of a few
#: Python-dispatched ops is small beside their work, small enough that a tile's scratch and output
#: stay in cache between its ops (docs/benchmarks.md, "Threads and tiles")
TILE_ELEMENTS = 1 << 19
#: the largest verification tile side; tiles hold whole scale blocks where the blocks are smaller
VERIFY_SIDE = 128
#: verified tiles per tensor besides the four corners (the last one holds the last partial block)
VERIFY_SEEDED = 2


class FastPathMismatch(HarnessError):
    """The fast path and the float64 reference disagree on a verified tile."""


class _ReferenceChecksPassed(Exception):
    """Raised by the stand-in weight when the reference starts computing: its checks are behind it."""


class _WeightStandIn(torch.Tensor):
    """A meta tensor with the packed weight's shape and dtype; any use beyond those stops the reference."""

    METADATA = {
        torch.Tensor.dtype.__get__,
        torch.Tensor.shape.__get__,
        torch.Tensor.ndim.__get__,
        torch.Tensor.dim,
        torch.Tensor.size,
    }

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        raise _ReferenceChecksPassed


def run_reference_checks(fmt: QuantFormat, knobs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], packed: str):
    """Every refusal of `fmt.dequantize` (a FormatError), without its float64 arithmetic."""
    stand_in = dict(tensors)
    if packed in tensors:
        real = tensors[packed]
        stand_in[packed] = torch.empty(real.shape, dtype=real.dtype, device="meta").as_subclass(_WeightStandIn)
    try:
        fmt.dequantize(stand_in, knobs)
    except _ReferenceChecksPassed:
        pass


@dataclass(frozen=True)
class Tile:
    """A verification tile [rows, cols] of the weight."""

    rows: slice
    cols: slice


def tile_side(block: int, extent: int) -> int:
    """A tile side that never straddles a scale block boundary: whole blocks up to VERIFY_SIDE,
    or a divisor of a larger block (any side inside a block spanning the whole extent)."""
    if block <= VERIFY_SIDE:
        return block * (VERIFY_SIDE // block)
    if block >= extent:
        return VERIFY_SIDE
    return max(d for d in range(1, VERIFY_SIDE + 1) if block % d == 0)


def verification_tiles(shape: tuple[int, int], block: tuple[int, int], name: str, everything: bool) -> list[Tile]:
    """The four corner tiles (the last holds the last, partial, block) and VERIFY_SEEDED more
    drawn from a generator seeded by the tensor's name; every tile with `everything`."""
    rows, cols = shape
    th, tw = tile_side(block[0], rows), tile_side(block[1], cols)
    grid = (ceil_div(rows, th), ceil_div(cols, tw))
    if everything:
        places = [(i, j) for i in range(grid[0]) for j in range(grid[1])]
    else:
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        seeded = [tuple(int(torch.randint(n, (1,), generator=generator)) for n in grid) for _ in range(VERIFY_SEEDED)]
        corners = [(i, j) for i in (0, grid[0] - 1) for j in (0, grid[1] - 1)]
        places = list(dict.fromkeys(corners + seeded))
    return [Tile(slice(i * th, min((i + 1) * th, rows)), slice(j * tw, min((j + 1) * tw, cols))) for i, j in places]


def first_difference(fast: torch.Tensor, reference: torch.Tensor) -> tuple[int, ...] | None:
    """Where `fast` differs from the float64 `reference` rounded as the module docstring says
    (bit for bit, so -0 and 0 differ; NaN matches NaN); None when nowhere."""
    expected = reference.to(torch.float32).to(fast.dtype)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[fast.dtype]
    same = (fast.view(bits) == expected.view(bits)) | (fast.isnan() & expected.isnan())
    if bool(same.all()):
        return None
    return tuple(int(i) for i in (~same).nonzero()[0])


class _Scratch:
    """Buffers reused from tile to tile and tensor to tensor, grown when a larger one is asked for."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, role: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        buffer = self.buffers.get(role)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self.buffers[role] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]


class TileRunner:
    """Runs row tiles on torch.get_num_threads() worker threads, each over its own contiguous share
    of the rows with its own scratch. Each worker runs its ops on one torch thread (OpenMP's thread
    count is a per-thread setting; the worker restores it when its share is done), so torch runs
    every op inline in its worker: the workers never wait for one another inside an op, which on a
    shared machine costs more than the op, and tiles can be large (docs/benchmarks.md)."""

    def __init__(self, tile_elements: int = TILE_ELEMENTS):
        self.tile_elements = tile_elements
        self.scratch: list[_Scratch] = []
        self.pool: ThreadPoolExecutor | None = None
        self.pool_size = 0

    def run(self, tiles: list, work: Callable[[Any, _Scratch], None]) -> None:
        workers = max(1, min(torch.get_num_threads(), len(tiles)))
        self.scratch += [_Scratch() for _ in range(workers - len(self.scratch))]
        if workers == 1:
            for tile in tiles:
                work(tile, self.scratch[0])
            return
        if self.pool_size < workers:
            if self.pool is not None:
                self.pool.shutdown()
            self.pool, self.pool_size = ThreadPoolExecutor(workers, thread_name_prefix="fast-dequant"), workers
        shares = [tiles[i * len(tiles) // workers : (i + 1) * len(tiles) // workers] for i in range(workers)]
        threads = torch.get_num_threads()

        def share(index: int) -> None:
            torch.set_num_threads(1)
            try:
                for tile in shares[index]:
                    work(tile, self.scratch[index])
            finally:  # ATen also records the last count set as the default for threads it meets later (read, not measured)
                torch.set_num_threads(threads)

        list(self.pool.map(share, range(workers)))


def fp8_row_tiles(rows: int, block_rows: int, tile_rows: int) -> Iterator[tuple[int, int, int]]:
    """(first row, scale block rows in the tile, rows per block row): tiles of whole block rows
    where blocks are shorter than a tile, else pieces of one block row; the last block partial."""
    if block_rows >= tile_rows:
        for start in range(0, rows, block_rows):
            end = min(start + block_rows, rows)
            for first in range(start, end, tile_rows):
                yield first, 1, min(tile_rows, end - first)
        return
    per_tile, whole = tile_rows // block_rows, rows // block_rows
    for block in range(0, whole, per_tile):
        yield block * block_rows, min(per_tile, whole - block), block_rows
    if rows % block_rows:
        yield whole * block_rows, 1, rows % block_rows


#: the 256 int8 codes by their byte (two's complement), as float32
INT8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.int8).to(torch.float32)
_CODE_PAIRS: dict[bytes, torch.Tensor] = {}


def code_pairs(table: torch.Tensor) -> torch.Tensor:
    """Two bytes of codes read as one little-endian uint16 -> both their float32 values, as one int64
    (65536 entries, 512 KiB; made once per table)."""
    key = table.numpy().tobytes()
    if key not in _CODE_PAIRS:
        code = torch.arange(1 << 16)
        pairs = torch.stack([table[code & 0xFF], table[code >> 8]], dim=-1)
        _CODE_PAIRS[key] = pairs.view(torch.int64).reshape(-1)
    return _CODE_PAIRS[key]


class Fp8Kernel:
    """`fp8-block`, `ct-fp8-*`, `modelopt-fp8`, `autofp8`, `ct-mxfp8`, `ct-w8a8` and `quark-int8`: a one-byte code (e4m3 or int8) x its
    block's scale, one float32 multiply per element (a per-tensor scale is one block the size of
    the weight)."""

    packed = "weight"

    def __init__(self, scale: str, table: torch.Tensor | None = None):
        self.scale = scale
        #: the 256 codes, decoded from their bits (float32 holds every one exactly)
        self.table = E4M3_TABLE.to(torch.float32) if table is None else table
        #: both values of every two-byte pair of codes, for half the lookups (docs/benchmarks.md)
        self.pairs = code_pairs(self.table)

    def shape(self, tensors):
        return tuple(tensors[self.packed].shape)

    def scale_block(self, fmt, knobs, shape):
        return fmt.scale_block(knobs, shape)

    def fill(self, out, fmt, knobs, tensors, runner: TileRunner) -> None:
        rows, cols = out.shape
        block_rows, block_cols = fmt.scale_block(knobs, (rows, cols))
        stored = tensors[self.scale]
        if stored.dtype in (torch.uint8, torch.float8_e8m0fnu):  # UE8M0 block scales, by their bits
            grid = decode_ue8m0(self.scale, stored).to(torch.float32)  # a grid: a few values a block
        else:
            grid = stored.to(torch.float32)
        grid = grid.reshape(ceil_div(rows, block_rows), ceil_div(cols, block_cols))
        bn, bk = min(block_rows, rows), min(block_cols, cols)
        whole, full = cols // bk, cols // bk * bk
        codes = tensors[self.packed].contiguous().view(torch.uint8)
        # pairs of codes where every tile holds whole pairs at even offsets: even rows
        paired = cols % 2 == 0 and sys.byteorder == "little"
        table = (self.pairs if paired else self.table).to(out.device)

        def work(tile, scratch: _Scratch) -> None:
            first, blocks, height = tile
            last, block = first + blocks * height, first // bn
            source = codes[first:last].reshape(-1)
            source = source.view(torch.uint16) if paired else source
            indices = scratch.get("indices", torch.int32, source.numel(), out.device)
            indices.copy_(source)
            target = out[first:last]  # rows of a contiguous output: contiguous
            # float32 output: decoded in place (the tile stays in cache for the multiply)
            decoded = (
                target
                if out.dtype == torch.float32
                else scratch.get("decoded", torch.float32, target.numel(), out.device)
            )
            torch.index_select(table, 0, indices, out=decoded.view(-1).view(table.dtype))
            decoded, target = decoded.view(blocks, height, cols), target.view(blocks, height, cols)
            scales = grid[block : block + blocks, None, :, None]
            torch.mul(
                decoded[..., :full].unflatten(-1, (whole, bk)),
                scales[:, :, :whole],
                out=target[..., :full].unflatten(-1, (whole, bk)),
            )
            if full < cols:
                torch.mul(decoded[..., full:], scales[:, :, whole, :], out=target[..., full:])

        runner.run(list(fp8_row_tiles(rows, bn, max(1, runner.tile_elements // cols))), work)

    def sub_problem(self, fmt, knobs, tensors, tile: Tile) -> dict[str, torch.Tensor]:
        """The format's tensors for the weight tile alone (its scale blocks, every other tensor)."""
        rows, cols = self.shape(tensors)
        block_rows, block_cols = fmt.scale_block(knobs, (rows, cols))
        stored = tensors[self.scale]
        grid = stored.reshape(ceil_div(rows, block_rows), ceil_div(cols, block_cols))
        scales = grid[
            tile.rows.start // block_rows : ceil_div(tile.rows.stop, block_rows),
            tile.cols.start // block_cols : ceil_div(tile.cols.stop, block_cols),
        ]
        return dict(tensors) | {
            self.packed: tensors[self.packed][tile.rows, tile.cols],
            # stored as the format stores it: 0-dim, 1-D (per tensor, or one per row as AutoRound and
            # ModelOpt write them: the tile's rows), or a grid
            self.scale: scales.reshape(())
            if stored.dim() == 0
            else scales.reshape(-1)
            if stored.dim() == 1
            else scales,
        }


class Int4InInt8Kernel(Fp8Kernel):
    """`ct-w4a8`: int4 codes one per int8 byte, read as ct-w8a8's, after the one check of their
    values the reference makes (run_reference_checks stops at the first read of the codes)."""

    def fill(self, out, fmt, knobs, tensors, runner: TileRunner) -> None:
        require_int4_codes(tensors[self.packed])
        super().fill(out, fmt, knobs, tensors, runner)


class IntKernel:
    """`ct-int4`, `ct-int8`: each byte of the int32 words holds 8/b columns (low bits first, the
    words read least significant byte first on a little-endian machine); one lookup per byte in a
    table of its codes, the group's zero point subtracted (an integer: exact), then one float32
    multiply by the group's scale per element."""

    packed, scale, shape_name, zero_name = "weight_packed", "weight_scale", "weight_shape", "weight_zero_point"

    def __init__(self, bits: int = 4):
        self.bits, self.per_byte = bits, 8 // bits
        codes = torch.arange(2**bits, dtype=torch.float32) - 2 ** (bits - 1)
        byte = torch.arange(256)
        mask = 2**bits - 1
        #: [packed byte] -> its codes in column order, as one int64 (two float32) or int32 (one)
        slots = torch.stack([codes[(byte >> (bits * i)) & mask] for i in range(self.per_byte)], dim=-1).contiguous()
        self.table = slots.view(torch.int64 if self.per_byte == 2 else torch.int32).reshape(-1)

    def shape(self, tensors):
        return read_weight_shape(tensors[self.shape_name])

    def scale_block(self, fmt, knobs, shape):
        return fmt.scale_block(knobs, shape)

    def fill(self, out, fmt, knobs, tensors, runner: TileRunner) -> None:
        if sys.byteorder != "little":
            raise HarnessError(f"the fast {fmt.name} dequantizer reads int32 words byte by byte (little-endian only)")
        rows, cols = out.shape
        group = fmt.scale_block(knobs, (rows, cols))[1]
        width = packed_extent(cols, self.bits) * 32 // self.bits  # columns the words hold, padding included
        whole, full = cols // group, cols // group * group
        packed = tensors[self.packed].contiguous().view(torch.uint8)  # [rows, 4 * words]
        scales = tensors[self.scale].to(torch.float32)
        zeros = None
        if self.zero_name in tensors:
            zeros = (unpack(tensors[self.zero_name], self.bits, rows, 0) - 2 ** (self.bits - 1)).to(torch.float32)
        table = self.table.to(out.device)
        tile_rows = max(1, runner.tile_elements // width)

        def work(first: int, scratch: _Scratch) -> None:
            last = min(first + tile_rows, rows)
            indices = scratch.get("indices", torch.int32, (last - first) * width // self.per_byte, out.device)
            decoded = scratch.get("decoded", torch.float32, (last - first) * width, out.device)
            indices.copy_(packed[first:last].reshape(-1))
            torch.index_select(table, 0, indices, out=decoded.view(table.dtype))
            decoded, target = decoded.view(last - first, width), out[first:last]
            if zeros is not None:
                decoded[:, :full].unflatten(-1, (whole, group)).sub_(zeros[first:last, :whole, None])
                if full < cols:
                    decoded[:, full:cols].sub_(zeros[first:last, whole:])
            torch.mul(
                decoded[:, :full].unflatten(-1, (whole, group)),
                scales[first:last, :whole, None],
                out=target[:, :full].unflatten(-1, (whole, group)),
            )
            if full < cols:
                torch.mul(decoded[:, full:cols], scales[first:last, whole:], out=target[:, full:])

        runner.run(list(range(0, rows, tile_rows)), work)

    def sub_problem(self, fmt, knobs, tensors, tile: Tile) -> dict[str, torch.Tensor]:
        """The words, scales (and zero points) and shape of the columns from the last boundary at or
        before the tile that is both a word's and a group's, to the tile's end (the tile is its last
        columns). Zero points are packed along the rows: the tile's rows are unpacked and packed again."""
        rows, cols = self.shape(tensors)
        group = fmt.scale_block(knobs, (rows, cols))[1]
        per_word = 32 // self.bits
        start, stop = tile.cols.start, tile.cols.stop
        start -= start % math.lcm(group, per_word)
        groups = slice(start // group, ceil_div(stop, group))
        problem = dict(tensors) | {
            self.packed: tensors[self.packed][tile.rows, start // per_word : ceil_div(stop, per_word)],
            self.scale: tensors[self.scale][tile.rows, groups],
            self.shape_name: torch.tensor(
                [tile.rows.stop - tile.rows.start, stop - start], dtype=tensors[self.shape_name].dtype
            ),
        }
        if self.zero_name in tensors:
            codes = unpack(tensors[self.zero_name], self.bits, rows, 0)[tile.rows, groups]
            problem[self.zero_name] = pack(codes, self.bits, 0)
        return problem


class Nvfp4Kernel:
    """NVFP4: one lookup per packed byte in a table of both its values for each group-scale code."""

    scale = "weight_scale"

    def __init__(self, packed: str, global_scale: str, convention: str):
        self.packed, self.global_scale, self.convention = packed, global_scale, convention

    def shape(self, tensors):
        packed = tensors[self.packed]
        return packed.shape[0], 2 * packed.shape[1]

    def scale_block(self, fmt, knobs, shape):
        return 1, NVFP4_GROUP

    def pair_table(self, per_tensor: float, dtype: torch.dtype, device) -> torch.Tensor:
        """[scale code * 256 + packed byte] -> (low-nibble value, high-nibble value) as one integer,
        each value e2m1 * e4m3 (exact in float32) then divided or multiplied by the per-tensor
        scale in float32, rounded once (then to bfloat16 where asked)."""
        values = E4M3_TABLE.to(torch.float32)[:, None] * E2M1_TABLE.to(torch.float32)[None, :]
        scale = torch.tensor(per_tensor, dtype=torch.float32)
        values = (values / scale if self.convention == nv.DIVIDE else values * scale).to(dtype)
        byte = torch.arange(256)
        pairs = torch.stack([values[:, byte & 0xF], values[:, byte >> 4]], dim=-1).contiguous()
        return pairs.view({torch.float32: torch.int64, torch.bfloat16: torch.int32}[dtype]).reshape(-1).to(device)

    def fill(self, out, fmt, knobs, tensors, runner: TileRunner) -> None:
        rows, cols = out.shape
        groups = cols // NVFP4_GROUP
        per_tensor = nv.read_per_tensor(self.global_scale, tensors[self.global_scale])
        table = self.pair_table(per_tensor, out.dtype, out.device)
        packed = tensors[self.packed].contiguous().view(rows, groups, NVFP4_GROUP // 2)
        scale_codes = tensors[self.scale].contiguous().view(torch.uint8).view(rows, groups, 1)
        pairs = out.view(table.dtype)
        tile_rows = max(1, runner.tile_elements // cols)

        def work(first: int, scratch: _Scratch) -> None:
            last = min(first + tile_rows, rows)
            count = (last - first) * groups
            indices = scratch.get("indices", torch.int32, count * NVFP4_GROUP // 2, out.device).view(-1, groups, 8)
            codes = scratch.get("scale_codes", torch.int32, count, out.device).view(-1, groups, 1)
            indices.copy_(packed[first:last])
            codes.copy_(scale_codes[first:last])
            torch.add(indices, codes, alpha=256, out=indices)
            torch.index_select(table, 0, indices.view(-1), out=pairs[first:last].view(-1))

        runner.run(list(range(0, rows, tile_rows)), work)

    def sub_problem(self, fmt, knobs, tensors, tile: Tile) -> dict[str, torch.Tensor]:
        cols = tile.cols
        return dict(tensors) | {
            self.packed: tensors[self.packed][tile.rows, cols.start // 2 : cols.stop // 2],
            self.scale: tensors[self.scale][tile.rows, cols.start // NVFP4_GROUP : cols.stop // NVFP4_GROUP],
        }


class Mxfp4Kernel:
    """`ct-mxfp4`: one lookup per packed byte in a table of both its values for each E8M0 scale
    code (a byte's scale is that of its 32-column group: 16 bytes per group, the last partial)."""

    scale = "weight_scale"
    #: bytes of weight_packed per scale group
    group_bytes = MXFP4_GROUP // 2

    def __init__(self, packed: str = "weight_packed"):
        self.packed = packed  # Quark's MXFP4 holds the codes in `weight`

    def shape(self, tensors):
        packed = tensors[self.packed]
        return packed.shape[0], 2 * packed.shape[1]

    def scale_block(self, fmt, knobs, shape):
        return 1, MXFP4_GROUP

    def pair_table(self, dtype: torch.dtype, device) -> torch.Tensor:
        """[scale code * 256 + packed byte] -> (low-nibble value, high-nibble value) as one integer,
        each e2m1 x 2**(code - 127) in float32 (exact, or inf past its range), then `dtype`."""
        powers = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - E8M0_BIAS)
        values = (powers[:, None] * E2M1_TABLE[None, :]).to(torch.float32).to(dtype)
        byte = torch.arange(256)
        pairs = torch.stack([values[:, byte & 0xF], values[:, byte >> 4]], dim=-1).contiguous()
        return pairs.view({torch.float32: torch.int64, torch.bfloat16: torch.int32}[dtype]).reshape(-1).to(device)

    def fill(self, out, fmt, knobs, tensors, runner: TileRunner) -> None:
        rows, cols = out.shape
        width, groups = cols // 2, ceil_div(cols, MXFP4_GROUP)
        whole = width // self.group_bytes
        table = self.pair_table(out.dtype, out.device)
        packed = tensors[self.packed].contiguous()
        scale_codes = tensors[self.scale].contiguous().view(torch.uint8)  # E8M0 by its bits, typed or not
        pairs = out.view(table.dtype)
        tile_rows = max(1, runner.tile_elements // cols)

        def work(first: int, scratch: _Scratch) -> None:
            last = min(first + tile_rows, rows)
            indices = scratch.get("indices", torch.int32, (last - first) * width, out.device).view(-1, width)
            codes = scratch.get("scale_codes", torch.int32, (last - first) * groups, out.device).view(-1, groups)
            indices.copy_(packed[first:last])
            codes.copy_(scale_codes[first:last])
            codes.mul_(256)
            full = whole * self.group_bytes
            indices[:, :full].unflatten(-1, (whole, self.group_bytes)).add_(codes[:, :whole, None])
            if full < width:
                indices[:, full:].add_(codes[:, whole:])
            torch.index_select(table, 0, indices.view(-1), out=pairs[first:last].view(-1))

        runner.run(list(range(0, rows, tile_rows)), work)

    def sub_problem(self, fmt, knobs, tensors, tile: Tile) -> dict[str, torch.Tensor]:
        cols = tile.cols
        return dict(tensors) | {
            self.packed: tensors[self.packed][tile.rows, cols.start // 2 : cols.stop // 2],
            self.scale: tensors[self.scale][tile.rows, cols.start // MXFP4_GROUP : ceil_div(cols.stop, MXFP4_GROUP)],
        }


#: built-in formats the fast path does not cover yet (their float64 reference is the only path)
WITHOUT_KERNEL = ("gptq", "awq", "unquantized", "quark-int4-channel")


def kernel_for(fmt: QuantFormat) -> Fp8Kernel | Nvfp4Kernel | IntKernel | Mxfp4Kernel:
    """The fast kernel of a built-in format; a plugin's format has none."""
    if isinstance(fmt, Fp8Block):
        return Fp8Kernel("weight_scale_inv")
    if isinstance(fmt, CtFp8 | ModeloptFp8 | AutoFp8):
        return Fp8Kernel("weight_scale")
    if isinstance(fmt, CtW8a8 | QuarkInt8):  # int8 codes x a per-row or per-tensor scale
        return Fp8Kernel("weight_scale", INT8_TABLE)
    if isinstance(fmt, CtIntGroups):
        return Int4InInt8Kernel("weight_scale", INT8_TABLE)
    if isinstance(fmt, CtMxfp8):  # e4m3 codes, E8M0 bytes per 32 columns: read by their bits
        return Fp8Kernel("weight_scale")
    if isinstance(fmt, CtPackQuantized):
        return IntKernel(fmt.bits)
    if isinstance(fmt, CtMxfp4):
        return Mxfp4Kernel(fmt.suffixes[0])
    if isinstance(fmt, CtNvfp4):
        return Nvfp4Kernel("weight_packed", "weight_global_scale", nv.DIVIDE)
    if isinstance(fmt, ModeloptNvfp4):
        return Nvfp4Kernel("weight", "weight_scale_2", nv.MULTIPLY)
    raise HarnessError(f"format '{fmt.name}' has no fast dequantizer; run without --fast")


class FastDequantizer:
    """Dequantizes one module at a time into `dtype`, reusing its scratch memory (and, with
    `reuse_output`, its output buffer: a returned tensor is then valid until the next call)."""

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        *,
        verify: bool = True,
        reuse_output: bool = False,
        tile_elements: int = TILE_ELEMENTS,
    ):
        if dtype not in OUTPUT_DTYPES.values():
            raise HarnessError(f"the fast dequantizer writes float32 or bfloat16, not {dtype}")
        self.dtype, self.verify, self.reuse_output = dtype, verify, reuse_output
        self.runner = TileRunner(tile_elements)
        self.outputs = _Scratch()

    def dequantize(
        self, fmt: QuantFormat, knobs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], name: str = "weight"
    ) -> torch.Tensor:
        """[N, K] in `self.dtype`; FormatError where the reference refuses, FastPathMismatch where
        a verified tile differs from it."""
        kernel = kernel_for(fmt)
        run_reference_checks(fmt, knobs, tensors, kernel.packed)
        shape = kernel.shape(tensors)
        device = tensors[kernel.packed].device
        if self.reuse_output:
            out = self.outputs.get("out", self.dtype, shape[0] * shape[1], device).view(shape)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=device)
        if out.numel():
            kernel.fill(out, fmt, knobs, tensors, self.runner)
            if self.verify:
                verify_tiles(fmt, knobs, tensors, out, name)
        return out


def verify_tiles(fmt, knobs, tensors, out: torch.Tensor, name: str, everything: bool = False) -> None:
    """Recompute tiles of `out` with the float64 reference; one line naming tensor and tile on a mismatch."""
    kernel = kernel_for(fmt)
    for tile in verification_tiles(
        tuple(out.shape), kernel.scale_block(fmt, knobs, tuple(out.shape)), name, everything
    ):
        reference = fmt.dequantize(kernel.sub_problem(fmt, knobs, tensors, tile), knobs)
        # a sub-problem ends where the tile ends and may start before it (int4 words and groups)
        reference = reference[:, reference.shape[1] - (tile.cols.stop - tile.cols.start) :]
        got = out[tile.rows, tile.cols]
        where = first_difference(got, reference)
        if where is not None:
            row, col = tile.rows.start + where[0], tile.cols.start + where[1]
            raise FastPathMismatch(
                f"{name}: the fast {str(out.dtype).removeprefix('torch.')} dequantizer disagrees with the float64 "
                f"reference in tile [{tile.rows.start}:{tile.rows.stop}, {tile.cols.start}:{tile.cols.stop}] "
                f"(first at [{row}, {col}]: {float(got[where])!r}, reference {float(reference[where])!r}); "
                "rerun without --fast"
            )


def fast_dequantize_checkpoint(
    directory: str | Path, dtype: torch.dtype = torch.float32, *, verify: bool = True, reuse_output: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """`reference.dequantize_checkpoint`'s names, order and refusals, in float32 or bfloat16.
    The checkpoint, its format and the dtype are checked here, before the first tensor is asked for."""
    checkpoint = Checkpoint(directory)
    fmt, knobs = format_and_knobs(checkpoint)
    for scheme in fmt.schemes(knobs):
        kernel_for(scheme)
    dequantizer = FastDequantizer(dtype, verify=verify, reuse_output=reuse_output)
    return _stream(checkpoint, fmt, knobs, dequantizer)


def _stream(checkpoint: Checkpoint, fmt: QuantFormat, knobs, dequantizer: FastDequantizer):
    dtype = dequantizer.dtype
    modules, plain = group_modules(checkpoint.names(), fmt, checkpoint.storage_dtypes())
    for module, parts in sorted(modules.items()):
        tensors = {suffix: checkpoint.tensor(name) for suffix, name in parts.items()}
        try:
            weight = dequantizer.dequantize(*fmt.for_module(module, knobs, tensors), tensors, f"{module}.weight")
        except FormatError as error:
            shard = checkpoint.shard_of(parts.get(fmt.marker, next(iter(parts.values()))))
            raise CheckpointError(shard, f"{module}: {error}") from None
        yield f"{module}.weight", weight
    for name in plain:
        yield name, checkpoint.tensor(name).to(dtype)
