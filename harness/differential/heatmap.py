"""Per-block error heatmaps as PNG, drawn with matplotlib (the `report` extra, imported lazily).

One cell per scale block of a weight, coloured by the block's worst |error| / tolerance: white
exact, yellow within tolerance, orange to dark red over it (log scale), black non-finite. The
colour bar and report.md's legend both come from `colour` and `LEGEND` here, so they agree."""

from __future__ import annotations

import math
from pathlib import Path
from textwrap import wrap

#: report.md's legend: the same four classes the colour bar shows
LEGEND = (
    "one cell per scale block, coloured by its worst |error| / tolerance: white exact, "
    "pale to deep yellow within tolerance (0 to 1), orange to dark red over it (log scale, 1x to 1000x and more), "
    "black NaN/inf"
)
EXTRA_MISSING = (
    "heatmaps need the `report` extra (matplotlib): `pip install 'quant-load-harness[report]'`; "
    "not drawn here for {count} finding(s)"
)
#: the colour bar's axis: a position per class, so that each class has its own stretch of the bar
EXACT, WITHIN, OVER, NONFINITE = (-1.0, 0.0), (0.0, 1.0), (1.0, 4.0), (4.0, 5.0)
OVER_DECADES = 3  # 1x .. 1000x over tolerance span the "over" stretch; beyond is its darkest colour
STEPS_PER_UNIT = 100


class HeatmapsUnavailable(ImportError):
    """matplotlib is not installed: the report goes on without pictures and says why."""


def position(ratio: float) -> float:
    """Where a block's error / tolerance sits on the colour bar's axis (the classes do not overlap)."""
    if not math.isfinite(ratio):
        return sum(NONFINITE) / 2
    if ratio <= 0:
        return sum(EXACT) / 2
    if ratio <= 1:
        return WITHIN[0] + 0.999 * ratio * (WITHIN[1] - WITHIN[0])
    decades = min(math.log10(ratio), OVER_DECADES) / OVER_DECADES
    return OVER[0] + 1e-6 + decades * (OVER[1] - OVER[0] - 2e-6)


def colour(at: float) -> tuple[float, float, float]:
    """RGB in 0..1 of a position on the colour bar's axis."""
    if at < EXACT[1]:
        return (1.0, 1.0, 1.0)
    if at <= WITHIN[1]:
        return (1.0, 1.0, 0.8 * (1 - (at - WITHIN[0]) / (WITHIN[1] - WITHIN[0])))
    if at <= OVER[1]:
        strength = (at - OVER[0]) / (OVER[1] - OVER[0])
        return (1.0 - 0.45 * strength, 0.6 * (1 - strength), 0.0)
    return (0.0, 0.0, 0.0)


def heatmap_figure(
    grid: list[list[float]],
    *,
    engine: str,
    module: str | None,
    shape: list[int] | None = None,
    block: list[int] | None = None,
):
    """The matplotlib Figure of one weight's per-block grid (rows: blocks of N, columns: blocks of K)."""
    try:
        from matplotlib.colors import ListedColormap, Normalize
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator
    except ImportError as error:
        raise HeatmapsUnavailable(str(error)) from None
    rows, cols = len(grid), max((len(row) for row in grid), default=0)
    values = [[position(v) for v in row] + [position(0.0)] * (cols - len(row)) for row in grid]
    low, high = EXACT[0], NONFINITE[1]
    steps = int(round((high - low) * STEPS_PER_UNIT))
    cmap = ListedColormap([colour(low + (i + 0.5) / STEPS_PER_UNIT) for i in range(steps)])
    norm = Normalize(vmin=low, vmax=high)

    width = min(11.0, max(6.5, 3.0 + 0.25 * cols))
    height = min(8.0, max(4.5, 2.0 + 0.25 * rows))
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(values or [[position(0.0)]], cmap=cmap, norm=norm, interpolation="nearest", aspect="auto")
    axes.set_xticks(range(0, max(cols, 1), -(-max(cols, 1) // 16)))  # block indices, at most 16 labelled
    axes.set_yticks(range(0, max(rows, 1), -(-max(rows, 1) // 16)))
    if 0 < max(rows, cols) <= 48:  # cell borders while cells are large enough to see them
        axes.set_xticks([c - 0.5 for c in range(cols + 1)], minor=True)
        axes.set_yticks([r - 0.5 for r in range(rows + 1)], minor=True)
        axes.grid(which="minor", color="0.75", linewidth=0.6)
        axes.tick_params(which="minor", length=0)
    block_n, block_k = (block or [None, None])[:2]
    axes.set_xlabel("column block of K" + (f" ({block_k} columns each)" if block_k else ""))
    axes.set_ylabel("row block of N" + (f" ({block_n} rows each)" if block_n else ""))
    details = []
    if shape:
        details.append(f"weight {' x '.join(map(str, shape))}")
    if block:
        details.append(f"scale block {' x '.join(map(str, block))}")
    details.append(f"{rows} x {cols} blocks")
    lines = [*wrap(engine, 70), *wrap(module or "weight", 70), ", ".join(details)]
    axes.set_title("\n".join(lines), fontsize=9)

    bar = figure.colorbar(image, ax=axes, fraction=0.08)
    ticks = {
        sum(EXACT) / 2: "exact",
        WITHIN[0]: "0",
        WITHIN[1]: "1x tol",
        **{OVER[0] + d * (OVER[1] - OVER[0]) / OVER_DECADES: f"{10**d}x" for d in range(1, OVER_DECADES + 1)},
        sum(NONFINITE) / 2: "NaN/inf",
    }
    ticks[OVER[1]] = f"≥{10**OVER_DECADES}x"
    bar.ax.yaxis.set_major_locator(FixedLocator(list(ticks)))
    bar.ax.set_yticklabels(list(ticks.values()), fontsize=8)
    bar.set_label("worst |error| / tolerance in the block")
    return figure


def write_heatmap(
    grid: list[list[float]],
    path: Path,
    *,
    engine: str,
    module: str | None,
    shape: list[int] | None = None,
    block: list[int] | None = None,
) -> Path:
    """Draw with the Agg backend (no display, no pyplot state) and write `path`; raises
    HeatmapsUnavailable without matplotlib."""
    figure = heatmap_figure(grid, engine=engine, module=module, shape=shape, block=block)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path
