"""Judge every rank's shard against the slice of the reference it must own.

A rank is exact when what it computes equals the reference's slice: its held weight and scales
dequantized by the format's reference (one block grid over the fused rows, as vLLM's kernel reads
it; per-part scalars per part), compared bit for bit in float64 with the reference dequantization
of the whole checkpoint, sliced by `layout.owned_slice`. The held bytes of the quantized weight and
of every per-row scale are compared with the checkpoint's slice too, and a block grid's rows are
traced back to the checkpoint grid rows they were copied from, so a finding says which scale a
rank got and which it needed.

Under expert parallelism a rank owns whole routed experts: each expert it holds (in the slot vLLM's
expert_map gives it) must be that expert, all of it, and every expert must be held by exactly one
rank of the group (`expert_coverage`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from harness.core.dtypes import MODEL_DTYPES
from harness.core.errors import FormatError
from harness.core.spans import ranges
from harness.engines.vllm.tensor_parallel.layout import (
    EP,
    ROTARY_PERMUTED,
    TP,
    FusedLinear,
    Part,
    Slice,
    held_share,
    lane_config,
    lane_linears,
    owned_slice,
    part_piece,
    unpermute_rotary_rows,
    vocab_linears,
)

EXACT, FINDING, REFUSED = "exact", "finding", "refused"
#: parameters every forward applies as loaded: one that no loader wrote is uninitialised memory in the
#: outputs (a finding), unlike a placeholder a method drops or folds after loading (RankVerdict)
APPLIED_PARAMETERS = frozenset({"bias"})


@dataclass
class RankVerdict:
    tp: int  # the group's size (tensor- or expert-parallel)
    rank: int  # -1: the group as a whole (expert_coverage)
    module: str  # vLLM's fused name: qkv_proj, o_proj, gate_up_proj, down_proj
    status: str  # exact, finding or refused
    details: list[str] = field(default_factory=list)
    #: the checkpoint modules whose slice this rank holds wrong -> their whole weight's shape
    wrong: dict[str, list[int]] = field(default_factory=dict)
    parallel: str = TP
    #: parameters no loader wrote that the checkpoint does not store and no forward applies as they
    #: are (placeholders a method drops or folds after loading: a W4A16 NVFP4 Linear's input_scale)
    placeholders: list[str] = field(default_factory=list)

    def line(self) -> str:
        who = f"rank {self.rank} " if self.rank >= 0 else ""
        return f"{self.parallel} {self.tp} {who}{self.module}: {self.status}" + (
            f": {'; '.join(self.details)}" if self.details else ""
        )


@dataclass
class Shard:
    """What one rank holds of one fused Linear: held tensors (original dtypes) by parameter name."""

    tp: int
    rank: int
    linear: FusedLinear
    partition_sizes: list[int]
    block: list[int] | None
    held: dict[str, torch.Tensor]
    unwritten: dict[str, int] = field(default_factory=dict)
    refused: dict | None = None
    parallel: str = TP

    def split(self) -> tuple[int, int]:
        """(size, rank) the module is sliced by: a whole expert under expert parallelism."""
        return (1, 0) if self.parallel == EP else (self.tp, self.rank)


def shards_from_worker(report: dict, tensors: dict[str, torch.Tensor], config: dict) -> list[Shard]:
    """The worker's answer (float32 tensors, dtypes in the report) as Shards in their own dtypes."""
    shards = []
    for entry in report["shards"]:
        linear = {linear.name: linear for linear in lane_linears(config, entry["layer"])}[entry["module"]]
        held, unwritten, parallel = {}, {}, entry.get("parallel", TP)
        for name, meta in entry.get("params", {}).items():
            key = f"{parallel}{entry['tp']}/rank{entry['rank']}/{linear.module(entry['layer'])}.{name}"
            held[name] = tensors[key].to(getattr(torch, meta["dtype"]))
            unwritten[name] = meta["unwritten"]
        shards.append(
            Shard(
                entry["tp"],
                entry["rank"],
                linear,
                entry.get("partition_sizes") or [],
                entry.get("block"),
                held,
                unwritten,
                entry.get("refused"),
                parallel,
            )
        )
    return shards


@dataclass
class Truth:
    """The checkpoint's layer: raw tensors by name and the reference's float64 weights by name."""

    config: dict
    fmt: object
    knobs: dict
    layer: int
    raw: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor]


def load_truth(directory, layer: int) -> Truth:
    import json
    from pathlib import Path

    from harness.checkpoints.reader import Checkpoint
    from harness.oracle.reference import dequantize_checkpoint, format_and_knobs

    config = json.loads((Path(directory) / "config.json").read_text())
    # the layer's modules, and with layer 0 the vocabulary-parallel ones (layout.lane_linears)
    vocab = tuple(f"{linear.name}." for linear in vocab_linears(config)) if layer == 0 else ()
    prefixes = (f"model.layers.{layer}.", *vocab)
    checkpoint = Checkpoint(directory)
    config = lane_config(config, checkpoint.names())
    fmt, knobs = format_and_knobs(checkpoint)
    raw = {name: checkpoint.tensor(name) for name in checkpoint.names() if name.startswith(prefixes)}
    reference = {name: t for name, t in dequantize_checkpoint(directory) if name.startswith(prefixes)}
    return Truth(config, fmt, knobs, layer, raw, reference)


def judge(shards: list[Shard], truth: Truth, ep_sizes: list[int] = ()) -> list[RankVerdict]:
    return [judge_shard(shard, truth) for shard in shards] + expert_coverage(shards, truth, ep_sizes)


def expert_coverage(shards: list[Shard], truth: Truth, ep_sizes: list[int]) -> list[RankVerdict]:
    """Per expert-parallel size that vLLM did not refuse: every routed expert's w13 and w2 held by
    exactly one rank (a finding names the expert and the ranks, none or several)."""
    modules = [linear.name for linear in lane_linears(truth.config, truth.layer) if linear.expert is not None]
    verdicts = []
    for size in ep_sizes:
        mine = [shard for shard in shards if shard.parallel == EP and shard.tp == size]
        if not modules or any(shard.refused for shard in mine):
            continue
        holders = {module: sorted(s.rank for s in mine if s.linear.name == module) for module in modules}
        for module, ranks in holders.items():
            if len(ranks) != 1:
                held = f"held by ranks {', '.join(map(str, ranks))}" if ranks else "held by no rank"
                verdicts.append(RankVerdict(size, -1, module, FINDING, [f"{held} of {size}"], parallel=EP))
    return verdicts


def for_linear(truth: Truth, linear) -> Truth:
    """The truth as read for one Linear: in a mixed checkpoint (harness.formats.mixed), with the
    format and knobs of its config group (its first part's, as vLLM chooses one scheme per Linear)."""
    module = linear.part_module(truth.layer, linear.parts[0])
    tensors = {name.rpartition(".")[2]: t for name, t in truth.raw.items() if name.rpartition(".")[0] == module}
    try:
        fmt, knobs = truth.fmt.for_module(module, truth.knobs, tensors or None)
    except FormatError:
        return truth  # its tensors fit no group: the reference refuses them where they are read
    return truth if fmt is truth.fmt else replace(truth, fmt=fmt, knobs=dict(knobs))


def judge_shard(shard: Shard, truth: Truth) -> RankVerdict:
    truth = for_linear(truth, shard.linear)
    verdict = RankVerdict(shard.tp, shard.rank, shard.linear.name, EXACT, parallel=shard.parallel)
    if shard.refused:
        verdict.status = REFUSED
        verdict.details.append(f"in {shard.refused['stage']}: {shard.refused['error']}")
        return verdict
    unwritten = {
        name: f"{count} element(s) of {name} never written" for name, count in shard.unwritten.items() if count
    }
    placeholders = [
        name for name in unwritten if name not in APPLIED_PARAMETERS and not stores_parameter(shard, truth, name)
    ]
    problems = [line for name, line in unwritten.items() if name not in placeholders]
    size, rank = shard.split()
    slices = [owned_slice(shard.linear, part, size, rank, truth.config) for part in shard.linear.parts]
    if any(s is None for s in slices):
        problems.append(f"vLLM loaded a tp {shard.tp} split of {shard.linear.name} that has no even layout")
    else:
        if slices[0].padded:
            shard = unpadded(shard, slices[0], truth, problems)
        try:
            computed = dequantize_held(shard, truth) if slices[0].stop > slices[0].start else {}
        except (FormatError, ValueError, RuntimeError) as error:
            problems.append(f"the format's reference refuses the held tensors: {error}")
            computed = None  # every part's weight is unreadable: each is held wrong
        rounding = held_rounding(shard, truth)
        permuted = rotary_heads(shard, slices, truth)
        if permuted:  # what the rank computes, and the bytes it holds, in checkpoint row order
            if computed:
                computed = {
                    n: unpermute_rotary_rows(v, permuted[n]) if n in permuted else v for n, v in computed.items()
                }
            shard = unpermuted(shard, permuted)
        for part, owned in zip(shard.linear.parts, slices, strict=True):
            module = shard.linear.part_module(truth.layer, part)
            before = len(problems)
            if computed and part.name in computed:
                reference = truth.reference[shard.linear.reference_name(truth.layer, part)]
                expected = as_loaded(
                    cut(reference, owned), truth.raw.get(f"{module}.weight"), shard.held.get("weight"), truth
                )
                wrong = compare(computed[part.name], expected, owned, rounding and rounding[0])
                if wrong:
                    note = f" ({rounding[1]})" if rounding else ""
                    problems.append(f"{part.name} weight {wrong}{note}{block_trace(shard, part, owned, truth)}")
            problems += raw_problems(shard, part, owned, truth)
            if len(problems) > before or computed is None:
                verdict.wrong[module] = list(truth.reference[shard.linear.reference_name(truth.layer, part)].shape)
    if problems and shard.parallel == EP:
        problems.append(expert_held(shard, truth))
    if problems:
        verdict.status = FINDING
        verdict.details = problems + [unwritten[name] for name in placeholders]
    else:
        verdict.placeholders = placeholders
    return verdict


def stores_parameter(shard: Shard, truth: Truth, name: str) -> bool:
    """Whether the checkpoint stores parameter `name` for any part of the shard's Linear."""
    return any(f"{shard.linear.part_module(truth.layer, part)}.{name}" in truth.raw for part in shard.linear.parts)


def rotary_heads(shard: Shard, slices: list[Slice], truth: Truth) -> dict[str, int]:
    """Llama-4's q and k parts, which vLLM's model permutes for its rotary embedding before any
    loader: how many whole heads of rows the rank holds of each. Empty for the others."""
    architecture = (truth.config.get("architectures") or ["?"])[0]
    if architecture not in ROTARY_PERMUTED or shard.linear.kind != "qkv":
        return {}
    head_dim = shard.linear.attention.head_dim
    return {
        part.name: (owned.stop - owned.start) // head_dim
        for part, owned in zip(shard.linear.parts, slices, strict=True)
        if part.shard_id in ("q", "k")
    }


def unpermuted(shard: Shard, permuted: dict[str, int]) -> Shard:
    """The shard with its per-row tensors' q/k rows put back in checkpoint order (a block grid,
    not one entry per row, stays as held: the kernel reads it over the permuted rows)."""
    rows = _held_rows(shard)
    held = {}
    for suffix, tensor in shard.held.items():
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            held[suffix] = tensor
            continue
        pieces = [tensor[start : start + size] for _, start, size in part_rows(shard, rows)]
        for index, (part, _, _) in enumerate(part_rows(shard, rows)):
            if part.name in permuted:
                pieces[index] = unpermute_rotary_rows(pieces[index], permuted[part.name])
        held[suffix] = torch.cat(pieces)
    return replace(shard, held=held)


def expert_held(shard: Shard, truth: Truth) -> str:
    """Which checkpoint expert's stored weight an expert-parallel slot holds (when it is wrong)."""
    suffix = next((s for s in (truth.fmt.suffixes[0], "weight") if s in shard.held), None)
    mine = f"experts.{shard.linear.expert}."
    matches = []
    for expert in range(1 << 16):
        names = [
            f"{shard.linear.part_module(truth.layer, part).replace(mine, f'experts.{expert}.')}.{suffix}"
            for part in shard.linear.parts
        ]
        if any(name not in truth.raw for name in names):
            break
        stored = torch.cat([truth.raw[name] for name in names])
        if suffix and stored.shape == shard.held[suffix].shape and same_values(shard.held[suffix], stored):
            matches.append(expert)
    if not matches:
        return f"its {suffix} is no expert's of the checkpoint"
    return f"its {suffix} is expert {', '.join(map(str, matches))}'s of the checkpoint"


def unpadded(shard: Shard, owned: Slice, truth: Truth, problems: list[str]) -> Shard:
    """The shard without the padding past the rank's share (vLLM rounds a gpt-oss rank's width up
    to whole groups); padding that is not zero bytes is a problem (the kernel reads it)."""
    module = shard.linear.part_module(truth.layer, shard.linear.parts[0])
    held = {}
    for suffix, tensor in shard.held.items():
        stored = truth.raw.get(f"{module}.{suffix}")
        columns = stored.shape[1] if stored is not None and stored.dim() > 1 else None
        share = held_share(owned, tensor.dim(), shard.linear.input_size, columns)
        if share is None:
            held[suffix] = tensor
            continue
        padding = torch.ones(tensor.shape, dtype=torch.bool)
        padding[share] = False
        nonzero = int(
            (tensor.contiguous().view(torch.uint8).reshape(tensor.numel(), -1).any(dim=1) & padding.reshape(-1)).sum()
        )
        if nonzero:
            problems.append(f"{nonzero} padding element(s) of {suffix} past the rank's share are not zero")
        held[suffix] = tensor[share]
    sizes = [owned.stop - owned.start] if owned.axis == 0 else shard.partition_sizes
    return replace(shard, held=held, partition_sizes=sizes)


def cut(tensor: torch.Tensor, owned: Slice) -> torch.Tensor:
    return tensor.narrow(owned.axis, owned.start, owned.stop - owned.start)


def part_rows(shard: Shard, held_rows: int) -> list[tuple[Part, int, int]]:
    """(part, first held row, rows) of each part in the fused held weight."""
    sizes = shard.partition_sizes if len(shard.partition_sizes) == len(shard.linear.parts) else [held_rows]
    result, start = [], 0
    for part, rows in zip(shard.linear.parts, sizes, strict=False):
        result.append((part, start, rows))
        start += rows
    return result


def dequantize_held(shard: Shard, truth: Truth) -> dict[str, torch.Tensor]:
    """Per part, the float64 weight the rank computes with: the fused held tensors through the
    format's reference, as vLLM's kernel reads them (per-part scalars part by part)."""
    fmt = truth.fmt
    knobs = truth.knobs
    if shard.block and "block_rows" in knobs:  # the grid the rank holds its scales on (vLLM may refine it)
        knobs = {**knobs, "block_rows": shard.block[0], "block_cols": shard.block[1]}
    quantized = {s: t for s, t in shard.held.items() if s in fmt.suffixes}
    stored_scales = [
        name
        for part in shard.linear.parts
        for suffix in fmt.suffixes[1:]
        if (name := f"{shard.linear.part_module(truth.layer, part)}.{suffix}") in truth.raw
    ]
    if fmt.suffixes[0] not in quantized or not stored_scales:  # a module the checkpoint leaves unquantized
        plain = shard.held["weight"].to(torch.float64)
        return {part.name: plain[start : start + rows] for part, start, rows in part_rows(shard, plain.shape[0])}
    layout = part_rows(shard, quantized[fmt.suffixes[0]].shape[0])
    # int4's weight_shape is vLLM's bookkeeping of one part, not what the rank holds: the kernel
    # reads the held rows and the rank's input columns
    columns = shard.linear.input_size // (shard.split()[0] if shard.linear.kind == "row" else 1)
    shaped = "weight_shape" in quantized
    quantized.pop("weight_shape", None)
    per_part = len(layout) > 1 and any(t.dim() == 1 and t.numel() == len(layout) for t in quantized.values())
    if not per_part:
        total = sum(rows for _, _, rows in layout)
        whole = fmt.dequantize_held(with_shape(quantized, total, columns) if shaped else quantized, knobs)
        return {part.name: whole[start : start + rows] for part, start, rows in layout}
    result = {}
    for index, (part, start, rows) in enumerate(layout):
        piece = {s: part_piece(t, index, len(layout), start, rows) for s, t in quantized.items()}
        result[part.name] = fmt.dequantize_held(with_shape(piece, rows, columns) if shaped else piece, knobs)
    return result


def with_shape(tensors: dict[str, torch.Tensor], rows: int, columns: int) -> dict[str, torch.Tensor]:
    return {**tensors, "weight_shape": torch.tensor([rows, columns], dtype=torch.int64)}


@functools.cache
def weight_tolerance(format_name: str, dtype: str):
    """cases/tolerances.toml's tolerances, read once per format and dtype (a check judges many shards)."""
    from harness.core.tolerances import load_tolerances

    return load_tolerances(format_name, dtype)


def model_dtype(truth: Truth) -> str:
    return truth.config.get("dtype") or truth.config.get("torch_dtype") or "bfloat16"


def as_loaded(
    value: torch.Tensor, stored: torch.Tensor | None, held: torch.Tensor | None, truth: Truth
) -> torch.Tensor:
    """A plain tensor (an unquantized weight, a bias) as every loader holds it: `value`, the stored
    tensor or its float64 reference, rounded once to the model dtype where the checkpoint stores it
    in another floating dtype and the rank holds it in the model's (AutoRound writes float32
    embeddings into a float16 model); else `value` unchanged. Still compared bit for bit."""
    dtype = MODEL_DTYPES.get(model_dtype(truth))
    if stored is None or held is None or not stored.is_floating_point():
        return value
    if stored.dtype in (dtype, held.dtype) or held.dtype != dtype:
        return value
    return value.to(dtype).to(value.dtype)


def held_rounding(shard: Shard, truth: Truth) -> tuple[tuple[float, float], str] | None:
    """Where a rank holds a floating-point scale in another dtype than the checkpoint stores it (vLLM
    allocates GPTQ/AWQ scales in the model dtype: float16 scales held as bfloat16), what it computes
    is the definition through that rounding: the weight tolerance of the model dtype
    (cases/tolerances.toml: (rel, abs)) and why; None where every scale is held as stored (then the
    comparison is bit for bit). A slice off by a group or a row moves weights far beyond it."""
    module = shard.linear.part_module(truth.layer, shard.linear.parts[0])
    for suffix, held in shard.held.items():
        stored = truth.raw.get(f"{module}.{suffix}")
        if suffix in truth.fmt.suffixes and stored is not None and stored.is_floating_point():
            if held.dtype != stored.dtype and held.is_floating_point():
                dtype = model_dtype(truth)
                tolerance = weight_tolerance(truth.fmt.name, dtype)
                why = f"{suffix} held as {str(held.dtype)[6:]}, stored {str(stored.dtype)[6:]}: compared within {dtype}'s weight tolerance"
                return (tolerance.weight_rel, tolerance.weight_abs), why
    return None


def compare(held: torch.Tensor, expected: torch.Tensor, owned: Slice, tolerance=None) -> str | None:
    """None when bit-identical (or, with `tolerance` (rel, abs), within it); else which checkpoint
    rows (or columns) differ and by how much."""
    if held.dim() == 1 and expected.dim() == 1:  # one value a row (the sinks: a head each)
        held, expected = held.unsqueeze(1), expected.unsqueeze(1)
    if held.shape != expected.shape:
        return f"has shape {list(held.shape)} where the rank must hold {list(expected.shape)}"
    if tolerance is None:
        bad = ~(held == expected)
    else:
        bad = ~((held - expected).abs() <= tolerance[0] * expected.abs() + tolerance[1])
    if not bad.any():
        return None
    lines = bad.any(dim=1 - owned.axis).nonzero().flatten().tolist()
    what = "rows" if owned.axis == 0 else "columns"
    finite = torch.isfinite(held) & bad
    delta = (held[finite] - expected[finite]).abs().max().item() if finite.any() else float("nan")
    return (
        f"differs from the reference at checkpoint {what} {ranges([owned.start + i for i in lines])} "
        f"(max |delta| {delta:.3g})"
    )


def raw_problems(shard: Shard, part: Part, owned: Slice, truth: Truth) -> list[str]:
    """The held bytes of the stored weight, per-row scales and biases against the checkpoint's slice."""
    module = shard.linear.part_module(truth.layer, part)
    layout = {p.name: (start, rows) for p, start, rows in part_rows(shard, _held_rows(shard))}
    start, rows = layout[part.name]
    problems = []
    # GPTQ/AWQ hold outputs along dim 1, packed along both axes: judged through the dequantized weight;
    # a tensor packed across rows (ct's asymmetric zero points) by its unpacked values
    packed = truth.fmt.packed_across_rows(truth.knobs)
    by_rows = truth.fmt.splits_by_rows(truth.knobs) or bool(packed)
    for suffix, held in shard.held.items():
        source = truth.raw.get(f"{module}.{suffix}")
        if source is None or held.dim() == 0 or (suffix != "bias" and held.dim() == 1):
            continue  # per-part scalars are judged through the dequantized weight
        if suffix in packed:
            problems += packed_rows_problems(shard, part, owned, truth, suffix)
            continue
        if not by_rows and suffix in truth.fmt.suffixes:
            continue
        grid = shard.block and suffix not in ("bias", truth.fmt.suffixes[0]) and held.dim() == 2
        if grid or held.shape[0] != _held_rows(shard) or source.shape[0] != part.rows:
            continue  # a block grid (one grid row can look like one scale per row): traced in block_trace
        mine = held[start : start + rows]
        if suffix == "bias" and owned.bias_zero:
            wanted = torch.zeros_like(source)  # gpt-oss's w2 bias: rank 0 holds it, the others zeros
        elif owned.axis == 1 and (suffix == "bias" or source.dim() == 1 or (source.shape[1] == 1 and not owned.padded)):
            # a row-parallel bias, or one scale per output row: every rank holds all (a gpt-oss expert's
            # one column of scales is one group's: split like its columns)
            wanted = source
        elif owned.axis == 0:
            wanted = source[owned.start : owned.stop]
        else:
            factor = columns_per_entry(source, shard.linear.input_size)
            if factor is None or owned.start % factor or owned.stop % factor:
                problems.append(split_entry(part, suffix, mine, source, owned, factor))
                continue
            wanted = source[:, owned.start // factor : owned.stop // factor]
        if suffix in ("weight", "bias"):  # an unquantized weight (a quantized one is codes) or a bias
            wanted = as_loaded(wanted, source, mine, truth)
        if mine.shape != wanted.shape:
            problems.append(f"{part.name} {suffix} held {list(mine.shape)}, the rank's slice is {list(wanted.shape)}")
        elif not same_values(mine, wanted):
            problems.append(f"{part.name} {suffix} differs from the checkpoint's slice{dtype_note(mine, wanted)}")
    return problems


def packed_rows_problems(shard: Shard, part: Part, owned: Slice, truth: Truth, suffix: str) -> list[str]:
    """A tensor packed across output rows (8 int4 zero points a word): the rank's rows may start inside
    a word, so its bytes are no slice of the checkpoint's; its values, unpacked over the fused rows it
    holds, must be the checkpoint's unpacked slice (a row-parallel rank: every row, its groups)."""
    held_rows = _held_rows(shard)
    start, rows = {p.name: (s, r) for p, s, r in part_rows(shard, held_rows)}[part.name]
    stored = truth.raw[f"{shard.linear.part_module(truth.layer, part)}.{suffix}"]
    try:
        mine = truth.fmt.unpack_rows(suffix, shard.held[suffix], held_rows, truth.knobs)[start : start + rows]
    except FormatError as error:
        return [f"{part.name} {suffix} cannot be read as {held_rows} rows: {error}"]
    source = truth.fmt.unpack_rows(suffix, stored, part.rows, truth.knobs)
    if owned.axis == 0:
        wanted, first = source[owned.start : owned.stop], owned.start
    else:
        factor = columns_per_entry(source, shard.linear.input_size)
        if factor is None or owned.start % factor or owned.stop % factor:
            return [split_entry(part, suffix, mine, source, owned, factor)]
        wanted, first = source[:, owned.start // factor : owned.stop // factor], 0
    if mine.shape != wanted.shape:
        return [f"{part.name} {suffix} holds {list(mine.shape)} unpacked, the rank's slice is {list(wanted.shape)}"]
    wrong = (mine != wanted).any(dim=1).nonzero().flatten().tolist()
    if not wrong:
        return []
    return [
        f"{part.name} {suffix} (packed across rows) differs from the checkpoint's slice at checkpoint rows "
        f"{ranges([first + row for row in wrong])}"
    ]


def split_entry(part: Part, suffix: str, held: torch.Tensor, source: torch.Tensor, owned: Slice, factor) -> str:
    """A row-parallel rank whose columns start or end inside a stored entry (an NVFP4 group):
    which stored columns it holds, against those its columns need."""
    text = f"{part.name} {suffix}: the rank's columns {owned.start}-{owned.stop - 1} cut "
    if factor is None:
        return text + f"across the {source.shape[1]} stored columns"
    held_from = []
    for j in range(held.shape[1]):
        matches = [m for m in range(source.shape[1]) if same_values(held[:, j], source[:, m])]
        held_from.append("/".join(map(str, matches)) or "none")
    need = ranges(list(range(owned.start // factor, (owned.stop - 1) // factor + 1)))
    return (
        text + f"entries of {factor} columns: it holds stored columns [{', '.join(held_from)}] of "
        f"{source.shape[1]}, its columns need {need}"
    )


def same_values(held: torch.Tensor, wanted: torch.Tensor) -> bool:
    """Same bytes when the dtypes agree; else the same values (vLLM holds bf16 channel scales as
    float32: an exact widening), with NaN never equal."""
    if held.dtype == wanted.dtype:
        return torch.equal(held.contiguous().view(torch.uint8), wanted.contiguous().view(torch.uint8))
    return bool((held.to(torch.float64) == wanted.to(torch.float64)).all())


def dtype_note(held: torch.Tensor, wanted: torch.Tensor) -> str:
    if held.dtype == wanted.dtype:
        return ""
    return f" (held as {str(held.dtype).removeprefix('torch.')}, stored {str(wanted.dtype).removeprefix('torch.')})"


def _held_rows(shard: Shard) -> int:
    return sum(shard.partition_sizes) if shard.partition_sizes else next(iter(shard.held.values())).shape[0]


def columns_per_entry(source: torch.Tensor, columns: int) -> int | None:
    """Weight columns per stored column of `source` (1 for FP8, 2 for packed NVFP4, 16 for its scales)."""
    if source.dim() < 2 or columns % source.shape[1]:
        return None
    return columns // source.shape[1]


def block_trace(shard: Shard, part: Part, owned: Slice, truth: Truth) -> str:
    """For a block-scaled column-parallel weight: which checkpoint grid rows the fused grid rows
    covering `part` hold (`3<-up_proj[1]`: fused grid row 3 holds up_proj's grid row 1), against
    the grid rows its checkpoint rows need."""
    if not shard.block or owned.axis != 0:
        return ""
    grid_name = next((s for s in shard.held if s in truth.fmt.suffixes and s != truth.fmt.suffixes[0]), None)
    if grid_name is None:
        return ""
    held = shard.held[grid_name].to(torch.float64)
    bn = shard.block[0]
    start = {p.name: s for p, s, _ in part_rows(shard, _held_rows(shard))}[part.name]
    first, last = start // bn, (start + owned.stop - owned.start - 1) // bn
    got = []
    for row in range(first, last + 1):
        sources = []
        for other in shard.linear.parts:
            grid = truth.raw.get(f"{shard.linear.part_module(truth.layer, other)}.{grid_name}")
            if grid is not None and grid.shape[1:] == held.shape[1:]:
                grid = grid.to(torch.float64)
                sources += [f"{other.name}[{m}]" for m in range(grid.shape[0]) if torch.equal(held[row], grid[m])]
        got.append(f"{row}<-{'/'.join(sources) or 'nothing in the checkpoint'}")
    need = ranges(sorted({r // bn for r in range(owned.start, owned.stop)}))
    return (
        f"; vLLM's kernel reads fused grid rows {first}-{last} for these rows, which hold [{', '.join(got)}]; "
        f"they need {part.name} grid rows {need}"
    )
