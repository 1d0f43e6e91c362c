"""What is wrong with a checkpoint itself, before any engine loads it (`python -m harness audit`).

Every problem is an `AuditFinding` (check, module, tensor, file, one-line reason); the checks are
`CHECKS`. What a format means is asked of the format module itself, never restated here: the
tensors a quantized module carries come from its own quantizer (run on a small sample weight),
its ignore-list key and `quantization_status` from its own config fragment, and whether the
tensors fit from its own reference dequantizer (`fmt.dequantize`), run with the weight on the
meta device so that memory holds the scales only. That dequantizer checks before it computes:
with every tensor on meta, a FormatError is a shape or dtype it refuses (a scale grid that does
not fit the weight); with the scales real and the weight on meta, a FormatError is a value it
refuses (a non-finite scale, an NVFP4 global scale in the other convention by magnitude,
`nvfp4_common.require_convention`); its arithmetic stops at the first operation that needs the
weight's values. The rule the oracle refuses with is the one the audit reports.

Memory: headers are read first; then each quantized module's scales (small) are loaded, and
every other tensor is streamed from the file in chunks of CHUNK_BYTES with plain reads (no
mmap), so the peak is the largest module's scales plus a few chunks, whatever the shard size.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy
import torch

from harness.checkpoints.model_layout import fused_experts
from harness.checkpoints.packed_experts import expert_views
from harness.checkpoints.reader import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    config_problems,
    contained_file,
    read_config,
    read_json,
    read_safetensors_header,
)
from harness.checkpoints.streaming import DTYPE_NAMES
from harness.core.errors import CheckpointError, HarnessError, UnsupportedCheckpoint, UnsupportedFormat
from harness.formats import auto_round, detect_format, equivalents, mixed_groups
from harness.formats.base import FormatError, QuantFormat
from harness.oracle.reference import QUANTIZED_STORAGE

#: every check, in report order, with what it means (docs/audit.md)
CHECKS = {
    "index": "the index and the shards disagree: a tensor listed but absent, stored but not listed, stored in "
    "two shards, a shard missing, unreadable or outside the directory",
    "config": "a quantization_config field engines misread: a scalar or one-element weight_block_size, a "
    "quantization_status other than the format's, a value the format cannot parse",
    "missing-scale": "a quantized weight without a tensor its format needs",
    "orphan-scale": "a scale without its quantized weight, or one the config does not declare",
    "ignore-list": "the ignore list against the stored dtypes: a module stored quantized but ignored, or a "
    "Linear stored unquantized but neither ignored nor left out of the config's targets",
    "layout": "the format's reference dequantizer refuses a module's shapes or dtypes: a scale grid that does "
    "not fit its weight, K not a multiple of the NVFP4 group",
    "scale-values": "non-finite, zero or subnormal scales, or ones not a power of two under scale_fmt ue8m0 "
    "(count and first location)",
    "global-scale": "a per-tensor scale the format refuses: the other NVFP4 convention by magnitude, or not positive",
    "weight-values": "non-finite values in a stored weight",
    "names": "tensor names that do not fit the architecture config.json names: a module its model does not have "
    "(an engine reports it unexpected and drops it), a module of the model with no tensor (left as initialised, "
    "random), experts under a naming other than the architecture's own",
}
#: transformers refuses a one-element weight_block_size and crashes on a scalar (cases/known_issues.toml)
SCALAR_BLOCK_ISSUE = "transformers-fp8-scalar-block-size-refused"
CHUNK_BYTES = 32 * 2**20
#: torch dtypes by safetensors name (the streaming writer's table, plus the ones it never writes)
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()} | {
    name: getattr(torch, attribute)
    for name, attribute in (
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("F8_E8M0", "float8_e8m0fnu"),
        ("U16", "uint16"),
        ("U32", "uint32"),
        ("U64", "uint64"),
        ("C64", "complex64"),
    )
    if hasattr(torch, attribute)
}
#: a 2-D `.weight` whose module's last name matches this is not a Linear (embeddings, norms)
NOT_LINEAR = re.compile(r"embed|wte|wpe|norm|^ln")
#: the sample weight the format's quantizer is asked which tensors it writes (K a multiple of 16)
SAMPLE_SHAPE = (32, 64)


@dataclass
class AuditFinding:
    check: str
    module: str
    tensor: str
    file: str
    reason: str


@dataclass
class Stored:
    """Where one tensor's bytes are: its file, its safetensors dtype and shape, its byte range."""

    file: str
    path: Path
    dtype: str
    shape: list[int]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class AuditResult:
    directory: str
    format: str
    findings: list[AuditFinding] = field(default_factory=list)
    tensors: int = 0
    files: int = 0
    bytes_read: int = 0
    #: what the reference refuses, "tensor: reason", in the order it meets them (the first decides)
    refusals: list[str] = field(default_factory=list)

    def add(self, check: str, tensor: str, file: str, reason: str, module: str | None = None) -> None:
        if check not in CHECKS:
            raise ValueError(f"unknown audit check {check!r}")
        module = tensor.rpartition(".")[0] if module is None else module
        self.findings.append(AuditFinding(check, *map(_text, (module, tensor, file, reason))))

    def to_json(self) -> dict:
        by_check = {c: sum(1 for f in self.findings if f.check == c) for c in CHECKS}
        return {
            "directory": self.directory,
            "format": self.format,
            "summary": {
                "problems": len(self.findings),
                "by_check": {c: n for c, n in by_check.items() if n},
                "tensors": self.tensors,
                "files": self.files,
                "bytes_read": self.bytes_read,
            },
            "findings": [asdict(f) for f in self.findings],
            "refusals": self.refusals,
        }


def _text(name: str) -> str:
    """A name as text any terminal or file takes: a file name that is not UTF-8 on disk (Python
    holds its bytes as lone surrogates) is shown with backslash escapes, never a crash."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def audit_checkpoint(directory: str | Path) -> AuditResult:
    """Audit one checkpoint directory. Raises CheckpointError (one line) only when there is nothing
    to audit: no directory, no readable config.json, no quantization_config of a known format, no
    index and no model.safetensors, an index without a weight_map."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(directory, "not a directory" if directory.exists() else "not found")
    config_path = contained_file(directory, CONFIG_FILE, CONFIG_FILE, referrer=directory)
    config = read_config(config_path)
    qconfig = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qconfig, dict):
        problem = "is not a JSON object" if not isinstance(config, dict) else "has no quantization_config object"
        raise CheckpointError(config_path, f"config.json {problem}: not a quantized checkpoint this audit reads")
    try:
        fmt = detect_format(qconfig)
    except UnsupportedFormat as error:
        raise UnsupportedCheckpoint(config_path, str(error)) from None
    except FormatError as error:
        raise CheckpointError(config_path, str(error)) from None
    result = AuditResult(str(directory), fmt.name)
    for problem in config_problems(config):
        result.add("config", "", CONFIG_FILE, problem, module="")
    tensors = read_layout(directory, result)
    fused = fused_experts(config, tensors)
    if fused:
        raise UnsupportedCheckpoint(config_path, fused)
    result.tensors = len(tensors)
    result.files = len({s.file for s in tensors.values()})
    tensors = per_expert(tensors)
    for scheme_config, scheme, scheme_tensors in by_scheme(qconfig, fmt, tensors):
        knobs = check_config(scheme_config, scheme, result)
        # a foreign config's ignore list
        audit_modules(scheme_tensors, equivalents.read_as(scheme_config), scheme, knobs, result)
    scan_unscaled(tensors, fmt, result)
    check_names(tensors, config, result)
    return result


def by_scheme(
    qconfig: dict, fmt: QuantFormat, tensors: dict[str, Stored]
) -> list[tuple[dict, QuantFormat, dict[str, Stored]]]:
    """(config, format, tensors) to audit as one scheme: the checkpoint whole, or for a mixed checkpoint
    (mixed) each config group with its config alone, the modules it stores and every plain tensor
    (a plain Linear its targets name is its to report). A quantized module is its targeting group's,
    or where no group names it (targets in the model's in-memory names), the group whose format stores
    its tensors' names (else the first, whose checks then report what does not fit)."""
    try:
        knobs = fmt.knobs_from_config(qconfig)
    except (HarnessError, TypeError, AttributeError, KeyError, IndexError, ValueError):
        knobs = {}  # the config is judged whole (check_config says what is wrong with it)
    members = fmt.groups(knobs) if knobs else ()
    if not members:
        return [(qconfig, fmt, tensors)]
    by_module: dict[str, dict[str, Stored]] = {}
    for name, stored in tensors.items():
        by_module.setdefault(name.rpartition(".")[0], {})[name.rpartition(".")[2]] = stored
    owned: dict[str, dict[str, Stored]] = {member.group: {} for member in members}
    plain: dict[str, Stored] = {}
    for module, parts in by_module.items():
        quantized = (set(parts) - {"weight", "bias"}) & set(fmt.suffixes) or (
            "weight" in parts and parts["weight"].dtype in QUANTIZED_STORAGE
        )
        if not quantized:
            plain |= {f"{module}.{suffix}": stored for suffix, stored in parts.items()}
            continue
        member = mixed_groups.targeting_group(knobs, module)
        member = member or fmt.fitting_by_names(set(parts), knobs) or members[0]
        owned[member.group] |= {f"{module}.{suffix}": stored for suffix, stored in parts.items()}
    return [(member.config, member.fmt, owned[member.group] | plain) for member in members]


# -- the names against the architecture ------------------------------------------------------------


def check_names(tensors: dict[str, Stored], config: dict, result: AuditResult) -> None:
    """Each stored module against the modules the architecture's model holds (a registered
    architecture only: harness.checkpoints.architectures), under canonical names (a VLM prefix
    stripped); KV-cache scales belong to attention modules."""
    from harness.checkpoints.kv_scales import is_kv_scale
    from harness.checkpoints.model_layout import known_layout, layout_settings
    from harness.core.naming import canonical_name

    if config_problems(config):  # a config no engine can use: that finding says it, no layout follows
        return
    arch = known_layout(config)
    if arch is None:
        return
    settings = layout_settings(config)
    stored: dict[str, str] = {}  # module -> one of its tensors
    for name in sorted(tensors):
        if not is_kv_scale(name):
            stored.setdefault(canonical_name(name).rpartition(".")[0], name)
    named = known_layout(config, [canonical_name(n) for n in tensors])
    if named.moe is not None and named.moe.parts != arch.moe.parts:
        ours = "/".join(named.moe.parts)
        for module in sorted(m for m in stored if ".experts." in m and m.rpartition(".")[2] in named.moe.parts):
            result.add(
                "names",
                stored[module],
                tensors[stored[module]].file,
                f"an expert named {ours}, not {arch.model_type}'s own {'/'.join(arch.moe.parts)}: the reference "
                "reads it; a loader that knows only the architecture's naming reports it unexpected and leaves "
                "the expert random",
            )
    expected = named.modules(settings)
    for module in sorted(set(stored) - expected):
        name = stored[module]
        result.add(
            "names",
            name,
            tensors[name].file,
            f"no module {module} in {arch.model_type}'s model: an engine reports its tensors unexpected and drops them",
        )
    for module in sorted(expected - set(stored)):
        result.add(
            "names",
            f"{module}.weight",
            "",
            f"{arch.model_type}'s model has {module} but the checkpoint stores no tensor for it: left as initialised",
            module=module,
        )


# -- the index and the shards -------------------------------------------------------------------


def per_expert(tensors: dict[str, Stored]) -> dict[str, Stored]:
    """Experts stored packed (gpt-oss) as one tensor per expert, each its own contiguous byte range
    of the packed tensor (harness.checkpoints.packed_experts), so every check runs per expert."""
    whole = {n: s.shape for n, s in tensors.items() if s.shape and s.shape[0] and s.nbytes % s.shape[0] == 0}
    views = expert_views(whole)  # a tensor whose bytes do not divide by its experts is judged whole
    if not views:
        return tensors
    result = {name: stored for name, stored in tensors.items() if name not in {v.stored for v in views.values()}}
    for name, view in views.items():
        stored = tensors[view.stored]
        size = stored.nbytes // stored.shape[0]
        result[name] = dataclasses.replace(
            stored, shape=list(view.shape), start=stored.start + view.expert * size, nbytes=size
        )
    return result


def read_layout(directory: Path, result: AuditResult) -> dict[str, Stored]:
    """Tensor name -> where it is stored; every disagreement between the index and the shards is
    a finding, and a tensor is audited where the index places it."""
    if not ((directory / INDEX_FILE).exists() or (directory / INDEX_FILE).is_symlink()):
        if not ((directory / SINGLE_FILE).exists() or (directory / SINGLE_FILE).is_symlink()):
            raise CheckpointError(directory, f"neither {INDEX_FILE} nor {SINGLE_FILE} found")
        return open_shard(directory, SINGLE_FILE, [], result) or {}
    index_path = contained_file(directory, INDEX_FILE, "index", referrer=directory)
    index = read_json(index_path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index_path, "index has no weight_map object with entries")
    listed: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        if isinstance(shard, str):
            listed.setdefault(shard, []).append(tensor)
        else:
            result.add("index", tensor, INDEX_FILE, f"the index names shard {shard!r}, not a file name")
    shards = {shard: open_shard(directory, shard, names, result) for shard, names in listed.items()}
    for path in sorted(directory.glob("*.safetensors")):
        if path.name not in listed:
            stray = open_shard(directory, path.name, [], result)
            if stray:
                result.add(
                    "index",
                    min(stray),
                    path.name,
                    f"a shard the index never names: its {len(stray)} tensor(s) are loaded by no engine",
                )
    return locate(weight_map, shards, result)


def locate(weight_map: dict, shards: dict[str, dict[str, Stored]], result: AuditResult) -> dict[str, Stored]:
    holders: dict[str, list[str]] = {}
    for shard, stored in shards.items():
        for name in stored or {}:
            holders.setdefault(name, []).append(shard)
    tensors = {}
    for tensor, shard in weight_map.items():
        stored = shards.get(shard) if isinstance(shard, str) else None
        if stored is None:
            continue  # a bad shard name, or a shard missing or unreadable: that is the finding
        if tensor in stored:
            tensors[tensor] = stored[tensor]
            continue
        elsewhere = holders.get(tensor, [])
        where = f"; it is stored in {', '.join(elsewhere)}" if elsewhere else ""
        result.add("index", tensor, shard, f"listed in the index but absent from {shard}{where}")
    for tensor, files in sorted(holders.items()):
        if len(files) > 1:
            result.add(
                "index",
                tensor,
                ", ".join(files),
                f"stored in {len(files)} shards; the index lists {weight_map.get(tensor, 'none of them')}",
            )
        elif tensor not in weight_map:
            result.add("index", tensor, files[0], "stored in a shard but not listed in the index: no engine loads it")
    return tensors


def open_shard(directory: Path, name: str, listed: list[str], result: AuditResult) -> dict[str, Stored] | None:
    """The shard's tensors, or None (and a finding) when it is missing, outside or unreadable."""
    try:
        path = contained_file(directory, name, "shard", referrer=directory / INDEX_FILE)
        header = read_safetensors_header(path)
        with path.open("rb") as handle:
            data_start = 8 + struct.unpack("<Q", handle.read(8))[0]
    except CheckpointError as error:
        count = f" ({len(listed)} tensor(s) listed there)" if listed else ""
        result.add("index", min(listed) if listed else "", name, f"{error.problem}{count}")
        return None
    except OSError as error:
        raise CheckpointError(directory / name, f"cannot be read ({error.strerror or error})") from None
    return {
        tensor: Stored(
            name,
            path,
            entry["dtype"],
            entry["shape"],
            data_start + entry["data_offsets"][0],
            entry["data_offsets"][1] - entry["data_offsets"][0],
        )
        for tensor, entry in header.items()
    }


# -- the config -----------------------------------------------------------------------------------


def check_config(qconfig: dict, fmt: QuantFormat, result: AuditResult) -> dict | None:
    """Config fields engines misread; the format's knobs, or None when the format cannot parse them."""
    block = qconfig.get("weight_block_size")
    scalar = isinstance(block, int) and not isinstance(block, bool)
    if scalar or (isinstance(block, list) and len(block) == 1):
        size = block if scalar else block[0]
        result.add(
            "config",
            "",
            CONFIG_FILE,
            f"weight_block_size {block!r} is {'a scalar' if scalar else 'a one-element list'}: transformers "
            f"{'crashes on' if scalar else 'refuses'} it (known issue {SCALAR_BLOCK_ISSUE}); write [{size}, {size}]",
            module="",
        )
    own = fragment(fmt)  # a status only where the config is the format's own (not AutoRound's over its tensors)
    expected = own.get("quantization_status") if qconfig.get("quant_method") == own.get("quant_method") else None
    if expected is not None and qconfig.get("quantization_status") != expected:
        result.add(
            "config",
            "",
            CONFIG_FILE,
            f"quantization_status is {qconfig.get('quantization_status')!r}, not {expected!r}: compressed-tensors "
            "then treats the stored tensors as not yet compressed",
            module="",
        )
    try:
        return fmt.knobs_from_config(qconfig)
    except UnsupportedFormat as error:  # a valid scheme the harness does not define: not the checkpoint's fault
        raise UnsupportedCheckpoint(CONFIG_FILE, str(error)) from None
    except (FormatError, TypeError, AttributeError, KeyError, IndexError, ValueError) as error:
        result.add("config", "", CONFIG_FILE, f"quantization_config: {error}", module="")
        return None


def fragment(fmt: QuantFormat, ignore: list[str] | None = None) -> dict:
    """The format's own quantization_config fragment, with its default knobs."""
    return fmt.quantization_config(fmt.resolve_knobs({}), ignore or [])


def ignore_entries(qconfig: dict, fmt: QuantFormat) -> list[str]:
    """The ignore list under the key the format writes it (`ignore`, `modules_to_not_convert`); for
    AutoRound's own config over GPTQ's or AWQ's tensors, what it leaves in 16 bits (`extra_config`,
    the blocks it does not quantize, a mixture's routers); and what the format's checkpoints leave
    plain unlisted (`QuantFormat.unlisted_plain`)."""
    if qconfig.get("quant_method") == auto_round.AUTO_ROUND:
        return auto_round.sixteen_bits(qconfig)
    qconfig = equivalents.read_as(qconfig)  # a foreign list under the key of the config it reads as (Quark's `exclude`)
    probe = ["\x00probe"]
    keys = [key for key, value in fragment(fmt, probe).items() if value == probe]
    entries = [entry for key in keys for entry in listed(qconfig.get(key)) if isinstance(entry, str)]
    return entries + list(fmt.unlisted_plain)


def listed(value) -> list:
    """A config list as written, or empty (absent, null, or not a list)."""
    return value if isinstance(value, list) else []


def matches(name: str, entry: str) -> bool:
    """A module name against an ignore or target entry as the engines read them: `re:` a regular
    expression (compressed-tensors), wildcards (ModelOpt; gpt-oss's `model.layers.*.self_attn`
    names the modules under it, as transformers reads it), else the name or a dotted suffix or
    prefix of it (transformers' modules_to_not_convert)."""
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], name) is not None
        except re.error:
            return False
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(name, entry) or fnmatch.fnmatchcase(name, entry + ".*")
    return name == entry or name.endswith("." + entry) or name.startswith(entry + ".")


def targeted(name: str, qconfig: dict) -> bool:
    """Whether the config asks for this Linear to be quantized: its config groups' targets (a class
    name such as `Linear` targets every one), or without targets every Linear but the output head,
    which transformers never converts."""
    groups = qconfig.get("config_groups")
    targets = [
        t
        for group in (groups.values() if isinstance(groups, dict) else [])
        if isinstance(group, dict)
        for t in listed(group.get("targets"))
        if isinstance(t, str)
    ]
    if not targets:
        return name.rpartition(".")[2] != "lm_head"
    return any((t[:1].isupper() and "." not in t) or matches(name, t) for t in targets)


# -- quantized modules ----------------------------------------------------------------------------


@dataclass
class ModuleView:
    name: str
    parts: dict[str, Stored]
    quantized: bool  # its weight is stored in the format's quantized dtype


def format_tensors(fmt: QuantFormat, knobs: Mapping | None) -> dict[str, torch.dtype]:
    """Suffix -> dtype of what the format's quantizer writes for one module: the knobs with a fixed
    set of choices (static input scales, the convention) taken from the config, sizes left default,
    and the reading knobs only a foreign config sets (a weight-only variant: no input scale)."""
    chosen = {k: v for k, v in (knobs or {}).items() if k in fmt.knobs and fmt.knobs[k].choices}
    reading = {k: v for k, v in (knobs or {}).items() if k not in fmt.knobs}
    sample = torch.linspace(-1.0, 1.0, math.prod(SAMPLE_SHAPE)).reshape(SAMPLE_SHAPE)
    resolved = fmt.resolve_knobs(chosen) | reading
    written = fmt.quantize(sample, resolved, model_dtype=torch.bfloat16, activation_amax=4.0)
    return {suffix: tensor.dtype for suffix, tensor in written.tensors.items()}


def module_views(tensors: dict[str, Stored], fmt: QuantFormat, quantized_dtype: torch.dtype) -> list[ModuleView]:
    """Modules holding any of the format's tensors other than a plain weight."""
    weight = fmt.suffixes[0]
    grouped: dict[str, dict[str, Stored]] = {}
    for name, stored in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in fmt.suffixes:
            grouped.setdefault(module, {})[suffix] = stored
    views = []
    for module, parts in sorted(grouped.items()):
        quantized = weight in parts and TORCH_DTYPES.get(parts[weight].dtype) == quantized_dtype
        if quantized or set(parts) - {weight}:
            views.append(ModuleView(module, parts, quantized))
    return views


def audit_modules(tensors: dict[str, Stored], qconfig: dict, fmt: QuantFormat, knobs, result: AuditResult) -> None:
    expected = format_tensors(fmt, knobs)
    weight = fmt.suffixes[0]
    ignore = ignore_entries(qconfig, fmt)
    for view in module_views(tensors, fmt, expected[weight]):
        check_parts(view, fmt, expected, result)
        if view.quantized and any(matches(view.name, e) for e in ignore):
            result.add(
                "ignore-list",
                f"{view.name}.{weight}",
                view.parts[weight].file,
                "stored quantized but the ignore list names it: an engine that honours the list loads a plain "
                "Linear and drops the scales",
            )
        scales = load_scales(view, weight, result)
        scanned = {
            suffix for suffix, tensor in scales.items() if scan_scale(f"{view.name}.{suffix}", view, tensor, result)
        }
        if qconfig.get("scale_fmt") == "ue8m0":
            for suffix, tensor in scales.items():
                scan_power_of_two(f"{view.name}.{suffix}", view, tensor, result)
        if knobs is not None and fmt.marker in view.parts:
            judge_with_oracle(view, fmt, knobs, scales, scanned, result)
    check_unquantized_linears(tensors, qconfig, fmt, ignore, result)


def check_parts(view: ModuleView, fmt: QuantFormat, expected: dict, result: AuditResult) -> None:
    weight = fmt.suffixes[0]
    if not view.quantized:
        stored = view.parts.get(weight)
        how = f"its {weight} is stored as {stored.dtype}" if stored else f"it has no {weight}"
        for suffix, part in sorted(view.parts.items()):
            if suffix != weight:
                result.add(
                    "orphan-scale", f"{view.name}.{suffix}", part.file, f"a scale without a quantized weight: {how}"
                )
        return
    for suffix in sorted(set(expected) - set(view.parts) - set(fmt.optional)):
        result.add(
            "missing-scale",
            f"{view.name}.{suffix}",
            view.parts[weight].file,
            f"the quantized {weight} has no {suffix}: a loader computes with an uninitialized or default scale",
        )
    for suffix in sorted(set(view.parts) - set(expected)):
        result.add(
            "orphan-scale",
            f"{view.name}.{suffix}",
            view.parts[suffix].file,
            "a tensor the config does not declare for this format (an engine reports it unexpected and drops it)",
        )


def check_unquantized_linears(
    tensors: dict[str, Stored], qconfig: dict, fmt: QuantFormat, ignore: list[str], result: AuditResult
) -> None:
    for name, stored in sorted(tensors.items()):
        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or len(stored.shape) != 2 or stored.dtype not in ("BF16", "F16", "F32"):
            continue
        if f"{module}.{fmt.marker}" in tensors or NOT_LINEAR.search(module.rpartition(".")[2]):
            continue
        if targeted(module, qconfig) and not any(matches(module, e) for e in ignore):
            result.add(
                "ignore-list",
                name,
                stored.file,
                f"stored as {stored.dtype}, not quantized, yet neither ignored nor outside the config's targets: an "
                "engine builds a quantized Linear for it and finds no scale",
            )


def load_scales(view: ModuleView, weight: str, result: AuditResult) -> dict[str, torch.Tensor]:
    """Every tensor of the module but its weight, loaded (scales are small)."""
    loaded = {}
    for suffix, stored in view.parts.items():
        if suffix != weight and stored.dtype in TORCH_DTYPES:
            loaded[suffix] = torch.cat(list(read_chunks(stored, result))).reshape(stored.shape)
    return loaded


def judge_with_oracle(
    view: ModuleView, fmt: QuantFormat, knobs: dict, scales: dict, scanned: set[str], result: AuditResult
) -> None:
    """The format's reference dequantizer on this module's shapes, then on its scales' values
    (module docstring); a refusal the audit's own checks did not already report is a finding."""
    weight = fmt.suffixes[0]
    if any(s.dtype not in TORCH_DTYPES for s in view.parts.values()):
        return
    meta = {s: torch.empty(p.shape, dtype=TORCH_DTYPES[p.dtype], device="meta") for s, p in view.parts.items()}
    for check, tensors in (("layout", meta), ("values", {**meta, **scales})):
        refusal = oracle_refusal(fmt, tensors, knobs)
        if refusal is None:
            continue
        named = refusal.split(" ", 1)[0]
        suffix = named if named in view.parts else weight if weight in view.parts else fmt.marker
        result.refusals.append(f"{view.name}.{suffix}: {refusal}")
        already = not view.quantized or suffix in scanned or refusal.startswith("missing tensor")
        if not already:  # else an orphan, missing-scale or scale-values finding already says it
            if check == "values":
                check = "global-scale" if view.parts[suffix].numel <= 1 else "scale-values"
            reason = f"the format's reference dequantizer refuses it: {refusal}"
            result.add(check, f"{view.name}.{suffix}", view.parts[suffix].file, reason)
        return


def oracle_refusal(fmt: QuantFormat, tensors: dict[str, torch.Tensor], knobs: dict) -> str | None:
    """The FormatError the format's dequantizer raises, or None once its checks have passed (the
    first operation on a meta tensor's values raises a RuntimeError: nothing is computed)."""
    try:
        fmt.dequantize(tensors, knobs)
    except FormatError as error:
        return str(error)
    except (RuntimeError, NotImplementedError):
        return None
    return None


# -- values ---------------------------------------------------------------------------------------


def read_chunks(stored: Stored, result: AuditResult) -> Iterator[torch.Tensor]:
    """The tensor's elements, flat, CHUNK_BYTES at a time, read from the file (no mmap)."""
    dtype = TORCH_DTYPES[stored.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    step = max(CHUNK_BYTES // itemsize, 1) * itemsize
    try:
        with stored.path.open("rb") as handle:
            handle.seek(stored.start)
            for offset in range(0, stored.nbytes, step):
                data = bytearray(min(step, stored.nbytes - offset))
                if handle.readinto(data) != len(data):
                    raise CheckpointError(stored.path, "shrank while it was read")
                result.bytes_read += len(data)
                yield torch.frombuffer(data, dtype=dtype)
    except OSError as error:
        raise CheckpointError(stored.path, f"cannot be read ({error.strerror or error})") from None
    if stored.nbytes == 0:
        yield torch.empty(0, dtype=dtype)


@dataclass
class Tally:
    """How many elements met a condition, and the first one: flat index and value."""

    count: int = 0
    first: int = -1
    value: float = 0.0

    def take(self, mask: numpy.ndarray, value_at: Callable[[int], float], offset: int) -> None:
        hits = int(numpy.count_nonzero(mask))
        if hits and self.first < 0:
            at = int(mask.argmax())
            self.first, self.value = offset + at, value_at(at)
        self.count += hits


def tally(chunks: Iterator[torch.Tensor], conditions: dict[str, Callable]) -> dict[str, Tally]:
    """Count each condition over the chunks. A 1-byte float (FP8) is judged through its 256 codes:
    each condition is evaluated once on torch's own decoding of every code, then looked up per
    byte, several times faster than widening the chunk."""
    tallies = {name: Tally() for name in conditions}
    offset = 0
    for chunk in chunks:
        if chunk.element_size() == 1:
            codes = chunk.view(torch.uint8).numpy()
            decoded = torch.arange(256, dtype=torch.uint8).view(chunk.dtype).to(torch.float32)
            for name, condition in conditions.items():
                table = condition(decoded).numpy()
                tallies[name].take(table[codes], lambda at, c=codes, d=decoded: float(d[int(c[at])]), offset)
        else:
            for name, condition in conditions.items():
                tallies[name].take(condition(chunk).numpy(), lambda at, c=chunk: float(c[at]), offset)
        offset += chunk.numel()
    return tallies


def location(flat: int, shape: list[int]) -> str:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return str(list(reversed(index)))


def describe(tally_: Tally, what: str, shape: list[int]) -> str:
    value = "" if what == "zero" else f": {tally_.value:.6g}"
    return f"{tally_.count} {what} value(s) of {math.prod(shape)} (first at {location(tally_.first, shape)}{value})"


def scan_scale(name: str, view: ModuleView, tensor: torch.Tensor, result: AuditResult) -> bool:
    """Non-finite, zero and subnormal scales; True when one was found."""
    try:
        tiny = torch.finfo(tensor.dtype).tiny
    except TypeError:  # not a floating-point dtype
        return False
    conditions = {
        "non-finite": lambda v: ~torch.isfinite(v),
        "zero": lambda v: v == 0,
        "subnormal": lambda v: (v != 0) & (v.abs() < tiny),
    }
    chunks = iter(tensor.reshape(-1).split(max(CHUNK_BYTES // tensor.element_size(), 1)))
    found = {what: t for what, t in tally(chunks, conditions).items() if t.count}
    suffix = name.rpartition(".")[2]
    for what, counted in found.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        why = {
            "non-finite": "no definition gives it a meaning; a loader must refuse it",
            "zero": "the block's weights all dequantize to 0 (a producer writes eps or 1 for an all-zero block)",
            "subnormal": f"below {dtype}'s smallest normal {tiny:.3g}: kernels that flush subnormals read 0",
        }[what]
        result.add("scale-values", name, view.parts[suffix].file, f"{describe(counted, what, tensor.shape)}: {why}")
    return bool(found)


def scan_power_of_two(name: str, view: ModuleView, tensor: torch.Tensor, result: AuditResult) -> None:
    """Under `scale_fmt: ue8m0` every stored float scale must be a power of two (E8M0-typed or byte
    scales are by construction)."""
    if not tensor.is_floating_point() or tensor.dtype == torch.float8_e8m0fnu:
        return
    chunks = iter(tensor.reshape(-1).split(max(CHUNK_BYTES // tensor.element_size(), 1)))
    odd = lambda v: torch.isfinite(v) & (v != 0) & (torch.frexp(v.to(torch.float64)).mantissa.abs() != 0.5)  # noqa: E731
    counted = tally(chunks, {"not a power of two": odd})["not a power of two"]
    if counted.count:
        suffix = name.rpartition(".")[2]
        result.add(
            "scale-values",
            name,
            view.parts[suffix].file,
            f"{describe(counted, 'not a power of two', tensor.shape)}: the config declares scale_fmt ue8m0; "
            "a loader must use them as stored or refuse, never round them",
        )


def scan_unscaled(tensors: dict[str, Stored], fmt: QuantFormat, result: AuditResult) -> None:
    """Stream every floating-point tensor that is not a scale (weights, biases, norms, embeddings),
    in file order, for NaN and inf."""
    scale_suffixes = set(fmt.suffixes) - {fmt.suffixes[0]}
    order = sorted(tensors.items(), key=lambda item: (item[1].file, item[1].start))
    for name, stored in order:
        dtype = TORCH_DTYPES.get(stored.dtype)
        if name.rpartition(".")[2] in scale_suffixes or dtype is None or not dtype.is_floating_point:
            continue
        counted = tally(read_chunks(stored, result), {"non-finite": lambda v: ~torch.isfinite(v)})["non-finite"]
        if counted.count:
            result.add(
                "weight-values",
                name,
                stored.file,
                f"{describe(counted, 'non-finite', stored.shape)}: every output it reaches is NaN",
            )
