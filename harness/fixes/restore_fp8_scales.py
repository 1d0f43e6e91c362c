"""Restore block-FP8 `weight_scale_inv` tensors that transformers dropped on load (seed 003).

The bug: when `quantization_config.modules_to_not_convert` names a Linear whose weight the checkpoint
stores in FP8 (Qwen3.6-27B-FP8 ships such a list), transformers on an FP8-capable GPU leaves that
module a plain bf16 `nn.Linear`. The raw e4m3 codes are cast into its weight (up to +-448) and the
scale is reported as an unexpected key, so the layer runs unscaled and the model prints garbage.
On CPU transformers dequantizes every weight that has a scale at load (`dequantize=True`), whatever
the list says, so the bug needs the GPU load path. The repair multiplies the checkpoint's block
scale back into each such weight, in place.

Rules, each decided per tensor and checked before that tensor is touched:

- Which tensors: every checkpoint `<module>.weight_scale_inv` whose live module has a floating
  weight that is not FP8. A live FP8 weight means the module was converted and uses its scale.
- Never scale twice: a weight is repaired only when it holds exactly the checkpoint's raw codes
  (`<module>.weight` read from the checkpoint and cast to the live dtype; every e4m3 value is exact
  in bf16, fp16 and fp32, so the comparison is exact). A dequantized weight never equals its codes
  unless every scale is 1, where repairing changes nothing. A magnitude rule ("all values on the
  e4m3 grid and |max| near 448") would be weaker: a dequantized weight whose scales are powers of
  two is also on the grid. `already_dequantized=True` makes the fix a no-op; `False` says the
  caller knows the weights are raw and replaces the comparison with the necessary condition that
  every value is representable in e4m3 (for checkpoints whose weight tensor cannot be compared).
- Block size: `weight_block_size` as [bn, bk], [b] or b; missing means transformers' default
  [128, 128]; an explicit null means one per-tensor scale. Edge blocks are partial (ceil grid).
- Transposed grids: a scale of shape [ceil(N/bn), ceil(K/bk)] is read as the format defines it.
  When that grid is square the other orientation fits too and cannot be told apart from the data
  (the codes of an absmax-quantized block look the same whichever scale belongs to it), so the
  definition's reading is used, as FP8Linear and the harness reference do. A scale of the
  transposed shape [ceil(K/bk), ceil(N/bn)] (not square) is transposed back when the block size is
  declared; when it was defaulted, the shape also fits an undeclared block size (e.g. [2, 3] is
  weight [384, 256] with blocks 128 transposed, or with blocks [192, 86]): that is ambiguous and
  the tensor is skipped with the reason.
- Meta or accelerate-offloaded weights cannot be repaired in place: skipped with a warning.
- Memory: in place, one block-row (at most 128 rows) at a time through a float64 buffer of
  [128, K] (an exact product: 4 significant bits times 24, so the result is rounded once); never
  a float32 copy of the whole weight. 4096x4096 bf16, blocks 128: 6.4 MiB peak extra resident
  memory against 193 MiB for `(w.float() * expanded_scale).to(bf16)`.
- A failure while writing (it allocates nothing, so it should not happen) restores the tensor's
  rows from the checkpoint's codes: a tensor is never left half-applied.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from harness.checkpoints.reader import CONFIG_FILE, contained_file, read_json, read_safetensors_header
from harness.core.errors import CheckpointError, first_line
from harness.fixes._shared import FP8_DTYPES, SkipTensor, live_module_name, offload_problem
from harness.fixes.base import Fix, FixReport
from harness.formats.base import FormatError
from harness.formats.fp8_block import parse_block_size

NAME = "restore-dropped-fp8-scales"
SCALE_SUFFIX = ".weight_scale_inv"
DEFAULT_BLOCK = (128, 128)  # FineGrainedFP8Config's default weight_block_size
FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
CHUNK_ROWS = 128  # rows read, compared or rescaled at once (a per-tensor scale is one block of every row)


def read_block_size(quantization_config: Mapping) -> tuple[tuple[int, int] | None, bool]:
    """(block, declared): the block from `weight_block_size` (None: one per-tensor scale) and
    whether the config declared it (a defaulted block cannot vouch for a transposed grid)."""
    if "weight_block_size" not in quantization_config:
        return DEFAULT_BLOCK, False
    value = quantization_config["weight_block_size"]
    if value is None:
        return None, True
    return parse_block_size(value), True


def variant_name(file_name: str, variant: str | None) -> str:
    """transformers' `_add_variant`: model.safetensors -> model.fp8.safetensors,
    model.safetensors.index.json -> model.safetensors.index.fp8.json."""
    if variant is None:
        return file_name
    stem, _, extension = file_name.rpartition(".")
    return f"{stem}.{variant}.{extension}"


def checkpoint_files(directory: Path, variant: str | None) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the (variant) index or the single (variant) file.
    Without `variant`, a checkpoint holding only variant files is refused with their names:
    guessing one could apply another checkpoint's scales."""
    index_name = variant_name("model.safetensors.index.json", variant)
    single_name = variant_name("model.safetensors", variant)
    index_path, single_path = directory / index_name, directory / single_name
    if index_path.exists():
        index = read_json(contained_file(directory, index_name, "index", referrer=directory), "index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index_path, "index has no weight_map")
        files = {
            shard: contained_file(directory, shard, "shard", referrer=index_path) for shard in set(weight_map.values())
        }
        return {name: files[shard] for name, shard in weight_map.items()}
    if single_path.exists():
        single = contained_file(directory, single_name, single_name, referrer=directory)
        return {name: single for name in read_safetensors_header(single)}
    found = sorted(
        {
            part
            for path in directory.glob("model*.safetensors*")
            for part in re.findall(r"^model(?:\.safetensors\.index)?\.([^.]+)\.(?:safetensors|json)$", path.name)
        }
    )
    hint = f"; variant files found ({', '.join(found)}): pass variant=" if found and variant is None else ""
    raise CheckpointError(directory, f"neither {index_name} nor {single_name} found{hint}")


class CheckpointTensors:
    """Lazily opened safetensors files (each opened once) and their checked headers, per tensor:
    a damaged shard or a tensor the index misplaces skips only the tensors it holds (SkipTensor),
    so a repair still mends every other module. harness.checkpoints.reader.Checkpoint, which the
    oracle uses, refuses the whole checkpoint instead; the two contracts differ on purpose. It also
    reads transformers' `variant=` file names and row slices."""

    def __init__(self, files: dict[str, Path], stack: ExitStack):
        self.files, self.stack = files, stack
        self.handles: dict[Path, object] = {}
        self.headers: dict[Path, dict] = {}

    def header(self, name: str) -> dict:
        path = self.files[name]
        if path not in self.headers:
            self.headers[path] = read_safetensors_header(path)
        if name not in self.headers[path]:
            raise SkipTensor(f"the index places {name} in {path.name} but that file lacks it")
        return self.headers[path][name]

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.handles[path]

    def tensor(self, name: str) -> torch.Tensor:
        self.header(name)
        return self._handle(name).get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor, read without reading the rest."""
        return self._handle(name).get_slice(name)[start:stop]


def scale_as_float64(scale: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """The checkpoint scale as float64 multipliers: float dtypes as is, UE8M0 exponents decoded."""
    if scale.dtype in FLOAT_SCALE_DTYPES or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        values = scale.to(torch.float64)
    elif scale.dtype == torch.uint8 and scale_fmt == "ue8m0":
        values = torch.exp2(scale.to(torch.float64) - 127.0)
    else:
        raise SkipTensor(f"scale has dtype {scale.dtype}, not a float scale")
    if not torch.isfinite(values).all():
        raise SkipTensor("scale holds NaN or inf: refusing to multiply it into the weight")
    return values


def orient_scale_grid(
    scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None, declared: bool
) -> tuple[torch.Tensor, tuple[int, int], bool]:
    """(grid [ceil(N/bn), ceil(K/bk)], block, transposed): the scale read as the format defines
    it, a non-square transposed grid turned back when the block size is declared (see the module
    docstring for why a square grid is read literally and a defaulted block refuses a transpose)."""
    if block is None:
        if scale.numel() != 1:
            raise SkipTensor(
                f"per-tensor quantization (weight_block_size null) needs one scale, got shape {list(scale.shape)}"
            )
        return scale.reshape(1, 1), (rows, cols), False
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    shape = tuple(scale.shape)
    if shape == grid:
        return scale, block, False
    if shape == grid[::-1]:
        if not declared:
            raise SkipTensor(
                f"ambiguous scale grid {list(shape)}: it is the transposed grid for the default block "
                f"{list(block)} but weight_block_size is not declared, so it may equally be the grid "
                "of another block size; refusing to guess"
            )
        return scale.t(), block, True
    raise SkipTensor(
        f"scale has shape {list(shape)} but weight [{rows}, {cols}] with block {list(block)} needs "
        f"{list(grid)} (or its transpose)"
    )


def check_raw_codes(weight: torch.Tensor, checkpoint: CheckpointTensors, weight_key: str | None) -> None:
    """Refuse unless the live weight holds raw FP8 codes: exactly the checkpoint's codes when
    `weight_key` is given, else (the caller vouches) at least values representable in e4m3."""
    rows, cols = weight.shape
    if weight_key is not None:
        if weight_key not in checkpoint.files:
            raise SkipTensor(f"the checkpoint has no {weight_key} to compare the live weight with")
        header = checkpoint.header(weight_key)
        if header["dtype"] != "F8_E4M3" or header["shape"] != [rows, cols]:
            raise SkipTensor(
                f"checkpoint {weight_key} is {header['dtype']} {header['shape']}, not F8_E4M3 "
                f"[{rows}, {cols}] like the live weight"
            )
    for start in range(0, rows, CHUNK_ROWS):
        live = weight[start : start + CHUNK_ROWS]
        if weight_key is not None:
            same = torch.equal(live, checkpoint.rows(weight_key, start, start + CHUNK_ROWS).to(live))
            problem = "does not hold the checkpoint's raw FP8 values"
        else:
            same = torch.equal(live, live.to(torch.float8_e4m3fn).to(live.dtype))
            problem = "holds values not representable in float8_e4m3fn, so they are not raw FP8 codes"
        if not same:
            raise SkipTensor(
                f"live weight {problem} (rows {start}..): already dequantized or changed after load; left as is"
            )


def multiply_block_rows(weight: torch.Tensor, grid: torch.Tensor, block: tuple[int, int]) -> None:
    """weight[r, c] *= grid[r // bn, c // bk], in place, at most CHUNK_ROWS rows of one block-row at
    a time. Everything it needs is allocated before the first row is written."""
    rows, cols = weight.shape
    bn, bk = min(block[0], rows), min(block[1], cols)
    column_scales = grid.to(device=weight.device, dtype=torch.float64).repeat_interleave(bk, dim=1)[:, :cols]
    buffer = torch.empty(min(bn, CHUNK_ROWS), cols, dtype=torch.float64, device=weight.device)
    for index, block_start in enumerate(range(0, rows, bn)):
        for start in range(block_start, min(block_start + bn, rows), CHUNK_ROWS):
            target = weight[start : min(start + CHUNK_ROWS, block_start + bn)]
            work = buffer[: target.shape[0]]
            work.copy_(target)
            work.mul_(column_scales[index])
            target.copy_(work)


def restore_rows(weight: torch.Tensor, checkpoint: CheckpointTensors, weight_key: str) -> None:
    """Put the checkpoint's raw codes back into a weight whose repair failed midway."""
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        weight[start : start + CHUNK_ROWS].copy_(checkpoint.rows(weight_key, start, start + CHUNK_ROWS))


def unconverted_weight(module: torch.nn.Module, key: str, report: FixReport) -> torch.Tensor:
    """The module's 2-D floating weight that transformers left unconverted and that may be written
    in place; SkipTensor with the reason otherwise (an offloaded one also warns)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise SkipTensor(f"module {type(module).__name__} has no weight tensor")
    if weight.dtype in FP8_DTYPES:
        raise SkipTensor(f"live weight is {weight.dtype}: the module was converted and uses its scale")
    problem = offload_problem(module, weight)
    if problem:
        report.warnings.append(f"{key}: {problem}")
        raise SkipTensor(problem)
    if not weight.is_floating_point():
        raise SkipTensor(f"live weight is {weight.dtype}, not a floating weight holding FP8 codes")
    if weight.dim() != 2:
        raise SkipTensor(f"live weight has {weight.dim()} dimensions; block scales are 2-D")
    return weight


def restore_dropped_fp8_scales(
    model: torch.nn.Module,
    checkpoint_dir: str | Path,
    *,
    key_mapping: Mapping[str, str] | None = None,
    already_dequantized: bool | None = None,
    variant: str | None = None,
) -> FixReport:
    """For every checkpoint `*.weight_scale_inv` whose live module weight is not FP8 and holds the
    raw codes, multiply the block scale in, in place. `key_mapping` is the mapping the load used
    (regex -> replacement, as transformers' `key_mapping`); `variant` the load's `variant=`.
    Report keys are live weight names where the module was found, checkpoint scale keys otherwise."""
    report = FixReport(NAME)
    directory = Path(checkpoint_dir)
    config = read_json(contained_file(directory, CONFIG_FILE, CONFIG_FILE, referrer=directory), CONFIG_FILE)
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        report.warnings.append(f"not an FP8 checkpoint (quant_method {method!r}): nothing to restore")
        return report
    try:
        block, declared = read_block_size(quantization)
    except FormatError as error:
        raise CheckpointError(directory / CONFIG_FILE, str(error)) from None
    scale_fmt = quantization.get("scale_fmt")
    files = checkpoint_files(directory, variant)
    live_modules = dict(model.named_modules())
    repaired_tensors: set[int] = set()

    with ExitStack() as stack, torch.no_grad():
        checkpoint = CheckpointTensors(files, stack)
        for scale_key in sorted(name for name in files if name.endswith(SCALE_SUFFIX)):
            checkpoint_module = scale_key.removesuffix(SCALE_SUFFIX)
            key = scale_key
            try:
                module_name = live_module_name(checkpoint_module, live_modules, key_mapping)
                key = f"{module_name}.weight"
                weight = unconverted_weight(live_modules[module_name], key, report)
                if already_dequantized:
                    raise SkipTensor("the caller says the load already dequantized (already_dequantized=True)")
                if weight.data_ptr() in repaired_tensors:
                    raise SkipTensor("this weight was already repaired through another checkpoint key")
                scale = scale_as_float64(checkpoint.tensor(scale_key), scale_fmt)
                grid, tensor_block, transposed = orient_scale_grid(scale, *weight.shape, block, declared)
                weight_key = f"{checkpoint_module}.weight"
                data = weight.data
                check_raw_codes(data, checkpoint, None if already_dequantized is False else weight_key)
            except SkipTensor as reason:
                report.skipped[key] = str(reason)
                continue
            except Exception as error:  # nothing was written yet: an unreadable tensor skips only itself
                report.skipped[key] = f"cannot check it: {type(error).__name__}: {first_line(error)}"
                continue
            try:
                multiply_block_rows(data, grid, tensor_block)
            except Exception as error:
                reason = f"repair failed midway ({type(error).__name__}: {error})"
                try:
                    restore_rows(data, checkpoint, weight_key)
                    report.skipped[key] = reason + "; raw values restored from the checkpoint"
                except Exception:
                    report.skipped[key] = reason
                    report.warnings.append(
                        f"{key}: {reason}; could not restore the raw values: the weight is "
                        "partially scaled, reload the model"
                    )
                continue
            repaired_tensors.add(data.data_ptr())
            report.repaired.append(key)
            if transposed:
                report.warnings.append(f"{key}: {scale_key} stored transposed {list(scale.shape)}; transposed back")
    return report


FIX = Fix(
    name=NAME,
    repairs=(
        "A block-FP8 Linear that transformers left unconverted (listed in modules_to_not_convert while its "
        "weight is FP8) holds the raw e4m3 codes in bf16 and its weight_scale_inv is dropped as an "
        "unexpected key: the layer runs unscaled and the model's output is garbage."
    ),
    engines=("transformers",),
    versions=">=5.0",  # reproduced with 5.23 on the FP8 (non-dequantize) load path; earlier releases untested
    formats=("fp8-block",),
    detection=(
        "The checkpoint is quant_method fp8 and has a <module>.weight_scale_inv whose live module weight is "
        "a floating, non-FP8 2-D tensor equal, element for element, to the checkpoint's float8_e4m3fn "
        "<module>.weight (the raw codes); converted modules (FP8 weights) and weights transformers already "
        "dequantized (not equal to their codes) do not match."
    ),
    apply=restore_dropped_fp8_scales,
    report="003-unsloth-restore-dropped-fp8-scales",
    kinds=("dropped-scale",),
)
