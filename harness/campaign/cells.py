"""The campaign's cells: format x architecture x dtype x family (cases/coverage.toml).

A cell narrows the recipe strategy: its family forces some recipe fields, and the perturbations,
perturbation knobs and layout fields the family does not force stay at their defaults, so that a
finding in a cell has the family as its one cause. Exploration visits the cells in turn
(harness.campaign.explore); `--shard I/N` takes every N-th of them in a fixed order.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harness.campaign.strategies import kernel_aligned_first, partial_block
from harness.checkpoints import disagreements
from harness.checkpoints.architectures import ARCHITECTURES
from harness.checkpoints.recipe import (
    LAYOUT_CHOICES,
    LAYOUT_DEFAULTS,
    PERTURB_DEFAULTS,
    layout_refusal,
    pairing_refusal,
    perturb_refusal,
)
from harness.core.errors import HarnessError
from harness.core.paths import CASES_DIR
from harness.differential.relations import RELATION_NAMES
from harness.engines.options import CAMPAIGN_VARIANTS
from harness.formats import FORMAT_NAMES, get_format

DEFAULT_FILE = CASES_DIR / "coverage.toml"
SECTIONS = ("knobs", "layout", "perturb", "sizes")
FAMILY_KEYS = {"why", "force", "formats", "archs", "dtypes", "relations", "variants"}
#: layout fields a cell holds at their default unless its family forces them
HELD_LAYOUT = (
    "split_scale",
    "key_prefix",
    "fused_scales",
    "quantize_lm_head",
    "quantize_embeddings",
    "kv_scales",
    "config_spelling",
    "producer_config",
)
#: the family size at whose pace smaller families are visited (visit_order): about that of a family
#: spanning every format, the top-level architectures and dtypes (plain, extreme-scale: 93 cells)
FAMILY_PACE = 100


@dataclass(frozen=True)
class Family:
    name: str
    why: str
    force: dict[str, tuple] = field(default_factory=dict, hash=False, compare=False)
    #: the formats, architectures and dtypes this family's cells span (empty: every format, the
    #: coverage's own architectures and dtypes)
    formats: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    #: relations every example of its cells checks, besides the one the campaign samples
    relations: tuple[str, ...] = ()
    #: engine variants every example of its cells also loads (harness.engines.options)
    variants: tuple[str, ...] = ()

    def knobs(self) -> list[str]:
        return [key.partition(".")[2] for key in self.force if key.startswith("knobs.")]


@dataclass(frozen=True)
class Cell:
    format: str
    arch: str
    dtype: str
    family: str

    @property
    def name(self) -> str:
        return f"{self.format}/{self.arch}/{self.dtype}/{self.family}"

    def key(self) -> bytes:
        """A stable key for this cell (Hypothesis's example database, seeds)."""
        return hashlib.sha256(self.name.encode()).digest()[:16]


@dataclass
class Coverage:
    """The cells of a campaign and the families behind them."""

    families: dict[str, Family]
    held: tuple[str, ...]
    dtypes: tuple[str, ...]
    archs: tuple[str, ...] = tuple(ARCHITECTURES)

    @classmethod
    def load(cls, path: Path = DEFAULT_FILE) -> Coverage:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise HarnessError(f"{path}: cannot read the coverage cells ({error})") from None
        unknown = set(data) - {"held", "dtypes", "archs", "family"}
        if unknown:
            raise HarnessError(f"{path}: unknown key(s) {sorted(unknown)}")
        families = {}
        for name, entry in data.get("family", {}).items():
            if set(entry) - FAMILY_KEYS:
                raise HarnessError(f"{path}: family {name}: unknown key(s) {sorted(set(entry) - FAMILY_KEYS)}")
            force = {key: tuple(values) for key, values in entry.get("force", {}).items()}
            for key in force:
                if key.partition(".")[0] not in SECTIONS or not key.partition(".")[2]:
                    raise HarnessError(f"{path}: family {name}: '{key}' is not one of {', '.join(SECTIONS)}.NAME")
            archs = _known(path, f"family {name}: archs", entry.get("archs", ()), ARCHITECTURES)
            dtypes = _known(path, f"family {name}: dtypes", entry.get("dtypes", ()), LAYOUT_CHOICES["dtype"])
            formats = _known(path, f"family {name}: formats", entry.get("formats", ()), FORMAT_NAMES)
            relations = _known(path, f"family {name}: relations", entry.get("relations", ()), RELATION_NAMES)
            variants = _known(path, f"family {name}: variants", entry.get("variants", ()), CAMPAIGN_VARIANTS)
            families[name] = Family(name, entry.get("why", ""), force, formats, archs, dtypes, relations, variants)
        dtypes = _known(path, "dtypes", data.get("dtypes", LAYOUT_CHOICES["dtype"]), LAYOUT_CHOICES["dtype"])
        archs = _known(path, "archs", data.get("archs", tuple(ARCHITECTURES)), ARCHITECTURES)
        return cls(families, tuple(data.get("held", ())), dtypes, archs)

    def force(self, cell: Cell) -> dict[str, tuple] | None:
        """The recipe fields `cell` forces (harness.campaign.strategies.recipes' `force`), or None
        when its family does not apply to its format (a knob the format lacks) or the format is
        not written for its architecture (gpt-oss and its MXFP4 layout go together)."""
        family = self.families[cell.family]
        fmt = get_format(cell.format)
        if pairing_refusal(fmt, ARCHITECTURES[cell.arch]):
            return None
        force: dict[str, tuple] = {"layout.dtype": (cell.dtype,)}
        for key, default in PERTURB_DEFAULTS.items():
            force[f"perturb.{key}"] = (default,)
        for key in HELD_LAYOUT:
            force[f"layout.{key}"] = (LAYOUT_DEFAULTS[key],)
        for knob in self.held:
            if knob in fmt.knobs:
                force[f"knobs.{knob}"] = (fmt.knobs[knob].default,)
        for key, values in family.force.items():
            values = _carried(key, values, fmt, cell.arch)
            if not values:
                return None
            force[key] = values
        return force

    def force_on_visit(self, cell: Cell, visit_round: int) -> dict[str, tuple] | None:
        """`force(cell)` with each field's values rotated to start at the cell's own offset plus
        `visit_round`: a visit's simplest example draws the first value of each field, so successive
        visits of a cell start from successive values (the disagreement family's kinds, the
        kv-scales family's namings). The offset is the cell's place among its family's cells of the
        same format (architecture by architecture, dtype by dtype) plus a hash of the format and
        family: those cells' first visits draw as many different values as there are cells, where
        offsets hashed cell by cell collided (8 disagreement cells of a format drew about 6 of its 11
        kinds), and each format starts elsewhere."""
        force = self.force(cell)
        if force is None:
            return None
        family = self.families[cell.family]
        siblings = [(a, d) for a in family.archs or self.archs for d in family.dtypes or self.dtypes]
        place = siblings.index((cell.arch, cell.dtype)) if (cell.arch, cell.dtype) in siblings else 0
        shift = hashlib.sha256(f"{cell.format}/{cell.family}".encode()).digest()[:4]
        offset = place + int.from_bytes(shift, "big") + visit_round
        return {key: values[offset % len(values) :] + values[: offset % len(values)] for key, values in force.items()}

    def cells(self, formats=None, archs=None, families=None) -> list[Cell]:
        """Every cell that exists, in the order exploration visits them (visit_order: families
        interleaved at a pace, small ones first and whole)."""
        found = []
        for family in families or self.families:
            if family not in self.families:
                raise HarnessError(f"unknown family '{family}' (known: {', '.join(self.families)})")
            spans = self.families[family]
            for fmt in [f for f in formats or FORMAT_NAMES if not spans.formats or f in spans.formats]:
                for arch in spans.archs or self.archs:
                    for dtype in spans.dtypes or self.dtypes:
                        cell = Cell(fmt, arch, dtype, family)
                        if (not archs or arch in archs) and self.force(cell) is not None:
                            found.append(cell)
        return visit_order(found)


def visit_order(cells: list[Cell]) -> list[Cell]:
    """`cells` in the order exploration visits them: each family's cells in a fixed order (by a hash
    of the name), the families interleaved at a pace: the r-th of a family's n cells goes at
    (r + 1/2) / max(n, FAMILY_PACE). A family of fewer cells than FAMILY_PACE (a crossing aimed at
    one mechanism) is thus visited early and whole, a larger one in proportion, so that a run the
    budget stops short of every cell leaves out the tails of the largest families rather than a
    random tenth of every family (session 40: the kv-cache-float32 cell went unreached so)."""
    families: dict[str, list[Cell]] = {}
    for cell in sorted(cells, key=lambda c: c.key()):
        families.setdefault(cell.family, []).append(cell)
    paced = [
        ((rank + 0.5) / max(len(members), FAMILY_PACE), cell.key(), cell)
        for members in families.values()
        for rank, cell in enumerate(members)
    ]
    return [cell for _, _, cell in sorted(paced, key=lambda item: item[:2])]


def _carried(key: str, values: tuple, fmt, arch: str) -> tuple:
    """Those of a family's `values` for recipe field `key` that this format and architecture can
    carry (none: the family does not apply to the cell)."""
    section, _, name = key.partition(".")
    if section == "knobs":
        knob = fmt.knobs.get(name)
        return tuple(v for v in values if knob is not None and v in knob.choices and v != knob.default)
    if section == "layout":
        return tuple(v for v in values if not layout_refusal(name, v, fmt, ARCHITECTURES[arch], {}))
    if section == "perturb" and name == "disagreement":  # kinds this format can carry (two shards are
        # always given, and a static input scale where the format can store one: recipes repair both)
        static = {"input_scale": True} if "input_scale" in fmt.knobs else {}
        config = fmt.quantization_config(fmt.resolve_knobs(static), [])
        return tuple(v for v in values if not perturb_refusal(name, v, fmt) and disagreements.applies(v, 2, config))
    if section == "perturb":
        return tuple(v for v in values if not perturb_refusal(name, v, fmt))
    if key == "sizes.alignment":  # "free" of or "kernel" for the multiple the format's draws hold to a
        # kernel's, whole "blocks" where it has column blocks
        return tuple(
            v
            for v in values
            if (v not in ("free", "kernel") or kernel_aligned_first(fmt.name))
            and (v != "blocks" or partial_block(fmt.name)[0] > 1)
        )
    if key == "sizes.expert_widths":  # only a mixture's experts are kept to grouped_mm's rows
        return values if ARCHITECTURES[arch].moe else ()
    return values


def _known(path: Path, what: str, values, known) -> tuple[str, ...]:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise HarnessError(f"{path}: {what} {unknown} unknown (known: {', '.join(known)})")
    return tuple(values)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N) -> (I, N); a one-line HarnessError otherwise."""
    index, sep, count = text.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        index = count = 0
    if not sep or count < 1 or not 1 <= index <= count:
        raise HarnessError(f"--shard expects I/N with 1 <= I <= N (e.g. 2/4), got '{text}'")
    return index, count


def shard_cells(cells: list[Cell], index: int, count: int) -> list[Cell]:
    """Shard `index` of `count` (1-based): every count-th cell of the fixed order, so shards
    are disjoint, together cover every cell, and each spans formats and families."""
    return [cell for position, cell in enumerate(cells) if position % count == index - 1]
