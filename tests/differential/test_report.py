"""Reports: heatmaps drawn with matplotlib (and a report without it), the coverage section, and a
summary line that counts what report.json holds."""

from __future__ import annotations

import json
import math
import sys

import pytest

from harness.core.findings import Finding
from harness.differential.heatmap import LEGEND, colour, heatmap_figure, position, write_heatmap
from harness.differential.report import render_coverage, write_report

GRID = [[0.0, 0.5, 1.0, 3.0], [math.inf, 1e5, math.nan, 0.02]]


def weight_finding(engine: str = "vllm", known: str | None = None, grid=GRID) -> Finding:
    item = Finding(
        engine=engine,
        engine_version="0.32.0",
        kind="weight-mismatch",
        format="fp8-block",
        message="model.layers.0.mlp.down_proj.weight: 5/98304 elements differ",
        arch="llama",
        dtype="bfloat16",
        module="model.layers.0.mlp.down_proj.weight",
        metrics={"shape": [256, 512], "block": [128, 128]},
        known_issue=known,
    )
    if grid is not None:
        item.metrics["block_ratio"] = [list(row) for row in grid]
    return item


def coverage_row(cell: str, examples: int, loaded: dict[str, int], refused: int = 0, new: int = 0) -> dict:
    fmt, arch, dtype, family = cell.split("/")
    engines = {
        engine: {"loaded": n, "refused": refused, "unsupported": 0, "failed": 0, "unavailable": 0}
        for engine, n in loaded.items()
    }
    return {
        "cell": cell,
        "format": fmt,
        "arch": arch,
        "dtype": dtype,
        "family": family,
        "examples": examples,
        "findings": new,
        "new": new,
        "engines": engines,
    }


def test_heatmap_figure_has_block_axes_a_title_and_a_colour_bar():
    figure = heatmap_figure(
        GRID, engine="vllm", module="model.layers.0.mlp.down_proj.weight", shape=[256, 512], block=[128, 128]
    )
    axes = figure.axes[0]
    assert axes.get_xlabel().startswith("column block of K") and "128" in axes.get_xlabel()
    assert axes.get_ylabel().startswith("row block of N") and "128" in axes.get_ylabel()
    title = axes.get_title()
    for part in ("vllm", "model.layers.0.mlp.down_proj.weight", "256 x 512", "scale block 128 x 128", "2 x 4 blocks"):
        assert part in title
    image = axes.images[0]
    assert image.get_array().shape == (2, 4)  # one cell per scale block
    assert image.colorbar is not None and image.colorbar.ax in figure.axes
    labels = [t.get_text() for t in image.colorbar.ax.get_yticklabels()]
    assert {"exact", "1x tol", "NaN/inf"} <= set(labels)


def test_heatmap_colours_are_the_legend_classes():
    """white exact, yellow within tolerance, orange-red over, black non-finite: as report.md says."""
    image = heatmap_figure(GRID, engine="e", module="m").axes[0].images[0]
    rgba = image.to_rgba(image.get_array())
    cell = {ratio: tuple(rgba[r][c][:3]) for r, row in enumerate(GRID) for c, ratio in enumerate(row)}
    assert cell[0.0] == (1.0, 1.0, 1.0)
    red, green, blue = cell[0.5]
    assert red == green == 1.0 and 0 < blue < 1  # yellow
    red, green, blue = cell[3.0]
    assert red > green > 0 and blue == 0  # orange
    assert cell[1e5][1] < 0.01 and cell[1e5][0] < cell[3.0][0]  # darker red further over
    assert cell[math.inf] == (0.0, 0.0, 0.0)
    nan = rgba[1][2][:3]
    assert tuple(nan) == (0.0, 0.0, 0.0)
    for ratio in (0.0, 0.5, 3.0, 1e5, math.inf):  # the colour bar's map is the colour function
        assert cell[ratio] == pytest.approx(colour(position(ratio)), abs=0.02)
    assert "white exact" in LEGEND and "yellow within tolerance" in LEGEND and "black NaN/inf" in LEGEND


def test_write_heatmap_writes_a_png_that_reads_back(tmp_path):
    from matplotlib.image import imread

    path = write_heatmap(GRID, tmp_path / "deep" / "map.png", engine="vllm", module="w", shape=[256, 512])
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_report_draws_the_heatmap_and_keeps_the_grid_out_of_the_json(tmp_path):
    write_report(tmp_path, [weight_finding()], [], {"vllm": {"version": "0.32.0", "status": "ran"}}, "t")
    report = json.loads((tmp_path / "report.json").read_text())
    (item,) = report["findings"]
    assert "block_ratio" not in item["metrics"]
    assert (tmp_path / item["heatmap"]).read_bytes().startswith(b"\x89PNG")
    markdown = (tmp_path / "report.md").read_text()
    assert f"![per-block error]({item['heatmap']})" in markdown and LEGEND in markdown
    assert not report["notes"]


def test_report_without_matplotlib_is_written_and_says_what_to_install(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # every `import matplotlib...` now raises ImportError
    findings = [weight_finding(), weight_finding("transformers")]
    write_report(tmp_path, findings, [], {"vllm": {"version": "0.32.0", "status": "ran"}}, "t")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [f["heatmap"] for f in report["findings"]] == [None, None]
    assert all("block_ratio" not in f["metrics"] for f in report["findings"])
    assert not (tmp_path / "heatmaps").exists()
    markdown = (tmp_path / "report.md").read_text()
    assert "heatmaps need the `report` extra" in markdown and "not drawn here for 2 finding(s)" in markdown
    assert "![per-block error]" not in markdown


def test_summary_line_counts_what_the_json_holds(tmp_path):
    findings = [weight_finding(grid=None), weight_finding("transformers", known="some-issue", grid=None)]
    write_report(tmp_path, findings, [], {}, "run", extra={"examples": 412, "shard": "1/4", "budget": "10m"})
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["examples"] == 412 and report["shard"] == "1/4" and report["budget"] == "10m"
    assert report["summary"] == {"findings": 2, "new": 1, "known": 1, "signatures": 2, "examples": 412}
    line = (tmp_path / "report.md").read_text().splitlines()[2]
    assert line.startswith(f"{report['examples']} example(s), {len(report['findings'])} finding(s)")
    assert "1 new, 1 known" in line


def test_extra_may_not_replace_what_the_report_writes(tmp_path):
    with pytest.raises(ValueError, match="findings"):
        write_report(tmp_path, [], [], {}, "t", extra={"findings": []})


def test_coverage_section_at_three_hundred_cells(tmp_path):
    rows = [coverage_row(f"fp8-block/llama/bfloat16/family{i:03d}", 0, {"transformers": 0}) for i in range(297)]
    rows += [
        coverage_row("fp8-block/llama/bfloat16/plain", 4, {"transformers": 4, "vllm": 3}, new=1),
        coverage_row("fp8-block/qwen2/float16/nonfinite-scale", 2, {"transformers": 0, "vllm": 0}, refused=2),
        coverage_row("ct-fp8/llama/bfloat16/plain", 3, {"transformers": 3, "vllm": 0}, refused=3),
    ]
    engines = {e: {"version": "1", "status": "ran"} for e in ("reference", "transformers", "vllm")}
    write_report(tmp_path, [], [], engines, "run", coverage=rows, extra={"examples": 9})
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["coverage"] == rows
    assert report["summary"]["cells_planned"] == 300 and report["summary"]["cells_reached"] == 3
    markdown = (tmp_path / "report.md").read_text()
    section = markdown[markdown.index("## Coverage") : markdown.index("## Checkpoints")]
    assert "3 of 300 planned cell(s) reached" in section and "9 example(s)" in section
    table = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(table) == 3  # reached cells only; the others are one line
    assert table[1].startswith("| `fp8-block/llama/bfloat16/plain` | 4 | 1 | **1** | 4/4 | 3/3 |")
    assert "| reference |" not in section  # an engine no row counts gets no column
    never = [line for line in section.splitlines() if line.startswith("Cells never reached")]
    assert len(never) == 1 and "(297)" in never[0] and "`fp8-block/llama/bfloat16/family296`" in never[0]
    assert "- transformers (1 cell(s)): `fp8-block/qwen2/float16/nonfinite-scale` (2 refused)" in section
    assert "- vllm (2 cell(s)): " in section and "`ct-fp8/llama/bfloat16/plain` (3 refused)" in section
    assert len(section.splitlines()) < 20


def test_coverage_names_an_engine_that_never_loaded_anywhere():
    rows = [coverage_row("a/b/c/d", 2, {"vllm": 0}), coverage_row("a/b/c/e", 1, {"vllm": 0})]
    rows[0]["engines"]["vllm"]["unavailable"] = 2
    rows[1]["engines"]["vllm"]["unavailable"] = 1
    text = "\n".join(render_coverage(rows, ["vllm"]))
    assert "- vllm: never loaded in any reached cell (3 unavailable)" in text


def test_coverage_when_every_engine_loaded_everywhere():
    text = "\n".join(render_coverage([coverage_row("a/b/c/d", 2, {"vllm": 2})], ["vllm"]))
    assert "Every engine loaded in every reached cell." in text and "Cells never reached (0): none." in text
