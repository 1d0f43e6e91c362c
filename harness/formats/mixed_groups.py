"""The groups of a mixed-precision config (harness/formats/mixed.py) and the group each Linear is in.

A config's groups (`members_of`), each with the single-group format its scheme reads as and the config
with that group alone: compressed-tensors' config groups; ModelOpt's MIXED_PRECISION groups (their
scheme from `quantized_layers`); GPTQ's `dynamic` patterns that store the Linears they match in other
bits, group size, symmetry or act-order, then the config's own scheme; AutoRound's `extra_config`
settings over GPTQ's packing, then the config's own scheme.

A Linear's group (`targeting_group`), as each family's own loader chooses: compressed-tensors 0.20
(`match_targets`, `_scheme_from_targets`) sorts targets, exact names first, then patterns, each kind in
string order, the first that names the Linear winning, else the class name `Linear`, its ignore list
first, a target repeated in a later group that group's; GPTQModel and vLLM take the first `dynamic`
pattern in the config's order (a `-:` one: unquantized); AutoRound's loader takes the `extra_config`
key equal to the name, else the first key found in it as a pattern (a 16-bit one: unquantized).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from harness.formats.base import FormatError, QuantFormat

#: the class name compressed-tensors' `_match_class` matches every Linear (and vLLM's LinearBase) by
LINEAR = "Linear"


class Member(NamedTuple):
    """One config group: its name, targets, the format and knobs its scheme reads as, and the
    checkpoint's quantization_config with this group alone."""

    group: str
    targets: tuple[str, ...]
    fmt: QuantFormat
    knobs: dict
    config: dict


#: ModelOpt's quant_algo of a config whose Linears are quantized in several formats
MODELOPT_MIXED = "MIXED_PRECISION"


#: how a Linear's group is chosen: compressed-tensors' sorted targets, the first that matches
#: (GPTQModel), or AutoRound's exact names, then its patterns in order (knobs["routes"])
SORTED, FIRST, AUTO_ROUND = "sorted", "first", "auto-round"
#: AutoRound's fields an `extra_config` entry may set that change how a Linear is stored
AUTO_ROUND_SCHEME = ("bits", "group_size", "sym")
#: AutoRound's bits for a Linear it leaves unquantized
SIXTEEN = 16
#: GPTQ's fields a `dynamic` override may set that change how a Linear is stored
GPTQ_SCHEME = ("bits", "group_size", "sym", "desc_act")


def _single_group_configs(config: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], dict]] | None:
    """Each group as (its name, its targets, a config of its own: the top level kept, the group's own
    scheme as the config's: compressed-tensors' `format`, ModelOpt's `quant_algo` and `group_size`,
    GPTQ's overridden fields), for a compressed-tensors config of two groups or more, a ModelOpt
    MIXED_PRECISION one or a GPTQ one with scheme overrides; None for any other config."""
    if config.get("quant_method") == "gptq":
        return _gptq_groups(config)
    if config.get("quant_method") == AUTO_ROUND:
        return _auto_round_groups(config)
    modelopt = config.get("quant_method") == "modelopt" and str(config.get("quant_algo")).upper() == MODELOPT_MIXED
    if config.get("quant_method") != "compressed-tensors" and not modelopt:
        return None
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) < 2:
        return None
    singles = []
    for name, group in groups.items():
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            return None  # a group that quantizes no weight (activations or attention only)
        single = {**config, "config_groups": {name: dict(group)}}
        own = _modelopt_scheme(config, group) if modelopt else {"format": group.get("format") or config.get("format")}
        if own is None:
            return None
        targets = tuple(str(t) for t in group.get("targets") or [])
        singles.append((str(name), targets, single | own))
    return singles


def gptq_overrides(config: Mapping[str, Any]) -> dict[str, dict]:
    """A GPTQ config's `dynamic` patterns that store the Linears they match otherwise (other bits,
    group size, symmetry or act-order), pattern -> those fields."""
    dynamic = config.get("dynamic")
    if not isinstance(dynamic, Mapping):
        return {}
    return {
        str(pattern): {k: v for k, v in fields.items() if k in GPTQ_SCHEME}
        for pattern, fields in dynamic.items()
        if not str(pattern).startswith("-:") and isinstance(fields, Mapping) and set(fields) & set(GPTQ_SCHEME)
    }


def auto_round_overrides(config: Mapping[str, Any]) -> dict[str, dict]:
    """AutoRound's `extra_config` entries that quantize the Linears they name otherwise than the config
    (other bits below 16, group size or symmetry), key -> those fields."""
    from harness.formats.gptq import AUTO_ROUND_PACKING, auto_round_packing

    extra = config.get("extra_config")
    if config.get("quant_method") != AUTO_ROUND or not isinstance(extra, Mapping):
        return {}
    if auto_round_packing(config) not in AUTO_ROUND_PACKING:  # GPTQ's packing only (its other packings: unsupported)
        return {}
    found = {}
    for key, fields in extra.items():
        own = {k: v for k, v in fields.items() if k in AUTO_ROUND_SCHEME} if isinstance(fields, Mapping) else {}
        bits = own.get("bits", config.get("bits"))
        if isinstance(bits, int) and bits < SIXTEEN and any(own[k] != config.get(k) for k in own):
            found[str(key)] = own
    return found


def _auto_round_groups(config: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], dict]] | None:
    """AutoRound's mixed bits as groups: one per distinct overriding setting (the config with its fields,
    its keys as targets), then the config's own scheme; each keeps only the other `extra_config` entries
    (the 16-bit ones)."""
    overrides = auto_round_overrides(config)
    if not overrides:
        return None
    rest = {k: v for k, v in config["extra_config"].items() if k not in overrides}
    base = {**config, "extra_config": rest}
    settings: dict[str, list[str]] = {}
    for key, fields in overrides.items():
        settings.setdefault(json_key(fields), []).append(key)
    groups = [(f"settings_{i}", tuple(keys), base | overrides[keys[0]]) for i, keys in enumerate(settings.values())]
    return [*groups, ("base", (LINEAR,), base)]


def auto_round_routes(config: Mapping[str, Any], members: list[Member]) -> list[tuple[str, str | None]]:
    """Every `extra_config` key in the config's order with the group it gives the Linears it names
    (None: left in 16 bits)."""
    owner = {key: member.group for member in members for key in member.targets if key != LINEAR}
    return [(str(key), owner.get(str(key))) for key in config.get("extra_config") or {}]


def _gptq_groups(config: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], dict]] | None:
    """A GPTQ config with scheme overrides as groups: one per overriding pattern (the config with its
    fields, targets the pattern), then the config's own scheme for every other Linear; each keeps only
    the `-:` patterns of `dynamic`."""
    overrides = gptq_overrides(config)
    if not overrides:
        return None
    negatives = {k: v for k, v in config["dynamic"].items() if str(k).startswith("-:")}
    base = {**config, "dynamic": negatives}
    groups = [(pattern, (f"re:{pattern.removeprefix('+:')}",), base | fields) for pattern, fields in overrides.items()]
    return [*groups, ("base", (LINEAR,), base)]


def _modelopt_scheme(config: Mapping[str, Any], group: Mapping[str, Any]) -> dict | None:
    """The quant_algo (and group_size) `quantized_layers` gives every Linear the group names, with
    `quantized_layers` itself left out; None where they differ or one is not listed."""
    layers = config.get("quantized_layers")
    targets = group.get("targets")
    if not isinstance(layers, Mapping) or not isinstance(targets, list) or not targets:
        return None
    schemes = {json_key(layers.get(target)) for target in targets}
    if len(schemes) != 1 or not isinstance(layers.get(targets[0]), Mapping):
        return None
    own = dict(layers[targets[0]])
    return {"quantized_layers": None} | {k: v for k, v in own.items() if k in ("quant_algo", "group_size")}


def json_key(value: Any) -> str:
    """A value as a hashable key (a layer's scheme, a dict)."""
    import json

    return json.dumps(value, sort_keys=True, default=str)


def members_of(config: Mapping[str, Any]) -> list[Member] | None:
    """The config's groups, each with the format its scheme reads as; None where the config is not
    several groups of compressed-tensors or one group's scheme is no format the harness reads."""
    from harness.core.errors import UnsupportedFormat
    from harness.formats import detect_format

    singles = _single_group_configs(config)
    if singles is None:
        return None
    members = []
    for name, targets, single in singles:
        try:
            fmt = detect_format(single)
            knobs = fmt.knobs_from_config(single)
        except (UnsupportedFormat, FormatError):
            return None
        members.append(Member(name, targets, fmt, knobs, single))
    return members


def ignore_list(config: Mapping[str, Any]) -> list[str]:
    """The Linears a mixed config leaves unquantized, as targets: its `ignore`, or GPTQ's `-:` patterns."""
    if config.get("quant_method") == "gptq":
        return [f"re:{p.removeprefix('-:')}" for p in config.get("dynamic") or {} if str(p).startswith("-:")]
    if config.get("quant_method") == AUTO_ROUND:  # its 16-bit entries are routes (auto_round_routes)
        from harness.formats.auto_round import outside_blocks
        from harness.formats.base import ROUTERS

        return outside_blocks(config) + list(ROUTERS)
    return [str(entry) for entry in config.get("ignore") or []]


def _names(target: str, module: str) -> bool:
    """compressed-tensors' `match_name`: a `re:` target matches from the start of the name, any
    other only the whole name."""
    if target.startswith("re:"):
        try:
            return re.match(target.removeprefix("re:"), module) is not None
        except re.error:
            return False
    return target == module


def targeting_group(knobs: Mapping[str, Any], module: str) -> Member | None:
    """The member whose scheme the config gives a Linear named `module` (knobs["order"]: compressed-
    tensors' sorted targets, or the first member with a matching target), None where the ignore list
    names it or no target does."""
    members, ignore = knobs["members"], knobs["ignore"]
    if any(_names(entry, module) or entry == LINEAR for entry in ignore):
        return None
    if knobs.get("order") == FIRST:
        return next((m for m in members if any(t == LINEAR or _names(t, module) for t in m.targets)), None)
    if knobs.get("order") == AUTO_ROUND:
        return _auto_round_route(knobs, module)
    owner: dict[str, Member] = {}
    for member in members:  # an OrderedDict in compressed-tensors: a later group's target wins
        for target in member.targets:
            owner[target] = member
    ordered = sorted(owner, key=lambda target: ("re:" in target, target))
    for target in ordered:
        if _names(target, module):
            return owner[target]
    return owner.get(LINEAR)


def _auto_round_route(knobs: Mapping[str, Any], module: str) -> Member | None:
    """AutoRound's loader: an `extra_config` key equal to the name decides, else the first key that,
    as a pattern, is found in it (`re.search`), else the config's own scheme; a 16-bit key: none."""
    groups = {member.group: member for member in knobs["members"]}
    routes = knobs["routes"]
    for key, group in routes:
        if key == module:
            return groups.get(group)
    for key, group in routes:
        try:
            if re.search(key, module):
                return groups.get(group)
        except re.error:
            continue
    return groups.get("base")


#: a decoder layer's index in a module name, and the rest of the name after it
LAYER = re.compile(r"\.layers\.(\d+)\.(.+)$")


def layer_assignments(names: list[str], knobs) -> dict[tuple, int]:
    """Each distinct way a decoder layer's stored Linears are named by the config groups' targets
    (every group that names each, not only the one compressed-tensors chooses: a loader may choose
    another) -> the first layer named so."""
    by_layer: dict[int, set[tuple]] = {}
    for name in names:
        module = name.rpartition(".")[0]
        found = LAYER.search(module)
        if found:
            naming = tuple(m.group for m in knobs["members"] if any(_names(t, module) for t in m.targets))
            by_layer.setdefault(int(found[1]), set()).add((found[2], naming))
    first: dict[tuple, int] = {}
    for layer, assignment in sorted(by_layer.items()):
        first.setdefault(tuple(sorted(assignment)), layer)
    return first
