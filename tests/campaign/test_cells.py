"""Cells: every family applies somewhere, a cell's recipes keep to it, shards partition the cells."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.campaign.cells import Coverage, parse_shard, shard_cells
from harness.campaign.strategies import HEAD_COUNT_RULES, recipes
from harness.checkpoints.disagreements import CHOICES as DISAGREEMENT_CHOICES
from harness.checkpoints.recipe import PERTURB_DEFAULTS
from harness.core.errors import HarnessError
from harness.formats import FORMAT_NAMES, get_format

COVERAGE = Coverage.load()
CELLS = COVERAGE.cells()


def test_every_family_applies_to_some_format_and_every_format_has_cells():
    assert {c.family for c in CELLS} == set(COVERAGE.families)
    assert {c.format for c in CELLS} == set(FORMAT_NAMES)
    assert len(CELLS) == len(set(CELLS))


def test_a_knob_family_applies_only_where_the_format_has_the_knob():
    for cell in CELLS:
        for knob in COVERAGE.families[cell.family].knobs():
            assert knob in get_format(cell.format).knobs, cell.name


def test_successive_visits_of_a_cell_start_from_successive_forced_values():
    """A visit's simplest example takes each forced field's first value: the rotation gives a
    disagreement cell's first visits each of its kinds once, and the family's cells different firsts."""
    cells = [c for c in CELLS if c.family == "disagreement"]
    # a compressed-tensors FP8 cell carries every kind (a status, and a static input scale to omit)
    cells.sort(key=lambda c: c.format != "ct-fp8-tensor")
    kinds = COVERAGE.force(cells[0])["perturb.disagreement"]
    assert set(kinds) == set(DISAGREEMENT_CHOICES) - {"none"}
    firsts = [COVERAGE.force_on_visit(cells[0], visit)["perturb.disagreement"][0] for visit in range(len(kinds))]
    assert sorted(firsts) == sorted(kinds)
    for visit in (0, 3):
        rotated = COVERAGE.force_on_visit(cells[0], visit)
        assert {key: set(values) for key, values in rotated.items()} == {
            key: set(values) for key, values in COVERAGE.force(cells[0]).items()
        }
    assert len({COVERAGE.force_on_visit(cell, 0)["perturb.disagreement"][0] for cell in cells}) > 3
    # a format's cells (one per architecture) start from as many different kinds as they can
    for fmt in {c.format for c in cells}:
        mine = [c for c in cells if c.format == fmt]
        firsts = {COVERAGE.force_on_visit(c, 0)["perturb.disagreement"][0] for c in mine}
        assert len(firsts) == min(len(mine), len(COVERAGE.force(mine[0])["perturb.disagreement"])), fmt


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), index=st.integers(0, len(CELLS) - 1))
def test_a_cells_recipes_keep_to_its_family_dtype_and_defaults(data, index):
    """What the family forces holds; every other perturbation stays at its default."""
    cell = CELLS[index]
    force = COVERAGE.force(cell)
    recipe = data.draw(recipes((cell.format,), (cell.arch,), force))
    resolved = recipe.resolved()
    assert (recipe.format, recipe.arch, resolved.layout["dtype"]) == (cell.format, cell.arch, cell.dtype)
    family = COVERAGE.families[cell.family].force
    for key, default in PERTURB_DEFAULTS.items():
        allowed = family.get(f"perturb.{key}", (default,))
        assert resolved.perturb[key] in allowed, (cell.name, key)
    for key, values in family.items():
        section, _, name = key.partition(".")
        if section == "knobs":
            assert (
                resolved.knobs[name] in values and resolved.knobs[name] != get_format(cell.format).knobs[name].default
            )
        elif section == "layout":
            assert resolved.layout[name] in values
        elif key == "sizes.tie_word_embeddings":
            assert resolved.settings["tie_word_embeddings"] in values
        elif key == "sizes.attention" and values == ("untied",):
            width = resolved.settings["num_attention_heads"] * resolved.settings["head_dim"]
            assert width != resolved.settings["hidden_size"]
        elif key == "sizes.heads":
            counts = (resolved.settings["num_attention_heads"], resolved.settings["num_key_value_heads"])
            assert any(HEAD_COUNT_RULES[value](*counts) for value in values), (cell.name, counts)


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_are_disjoint_and_cover_every_cell(count):
    shards = [shard_cells(CELLS, index, count) for index in range(1, count + 1)]
    assert sorted(c.name for s in shards for c in s) == sorted(c.name for c in CELLS)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("text", ["0/4", "5/4", "x/4", "1", "1/0", ""])
def test_a_bad_shard_is_one_line(text):
    with pytest.raises(HarnessError, match="--shard expects I/N"):
        parse_shard(text)


def test_the_cell_order_is_fixed_and_interleaves_formats():
    assert [c.name for c in Coverage.load().cells()] == [c.name for c in CELLS]
    first = CELLS[: len(CELLS) // 10]
    assert len({c.format for c in first}) > 1 and len({c.family for c in first}) > 1


def test_small_families_are_visited_early_and_whole_and_the_largest_families_tails_last():
    """visit_order: a run the budget stops short of every cell leaves out the tails of the largest
    families, never a one-mechanism crossing of a few cells (as a plain hash order could)."""
    sizes = {family: sum(1 for c in CELLS if c.family == family) for family in COVERAGE.families}
    head, tail = CELLS[: len(CELLS) // 10], CELLS[-(len(CELLS) // 10) :]
    assert {c.name for c in CELLS if sizes[c.family] <= 4} <= {c.name for c in head}
    assert all(sizes[c.family] > 50 for c in tail), sorted({c.family for c in tail})


def test_bad_coverage_files_are_one_line_errors(tmp_path):
    path = tmp_path / "coverage.toml"
    for text, message in (
        ('[family.x]\nforce = { "nowhere.k" = [1] }\n', "is not one of"),
        ("[family.x]\ncolour = 1\n", "unknown key"),
        ('dtypes = ["int8"]\n', r"dtypes \['int8'\] unknown"),
        ('archs = ["gpt2"]\n', r"archs \['gpt2'\] unknown"),
        ('[family.x]\narchs = ["gpt2"]\n', r"family x: archs \['gpt2'\] unknown"),
        ('[family.x]\nformats = ["fp9"]\n', r"family x: formats \['fp9'\] unknown"),
        ('[family.x]\nrelations = ["twice"]\n', r"family x: relations \['twice'\] unknown"),
        ('[family.x]\nvariants = ["vllm[dtype=int8]"]\n', r"family x: variants .* unknown"),
        ("stray = 1\n", "unknown key"),
        ("[family\n", "cannot read"),
    ):
        path.write_text(text)
        with pytest.raises(HarnessError, match=message):
            Coverage.load(path)
    with pytest.raises(HarnessError, match="unknown family"):
        COVERAGE.cells(families=("no-such-family",))


def test_a_family_spans_its_own_archs_and_dtypes(tmp_path):
    path = tmp_path / "coverage.toml"
    path.write_text(
        'archs = ["llama"]\ndtypes = ["bfloat16", "float16"]\n[family.a]\nforce = {}\n'
        '[family.b]\nforce = {}\narchs = ["mixtral", "phi3"]\ndtypes = ["float32"]\n'
    )
    cells = Coverage.load(path).cells(formats=["fp8-block"])
    assert {(c.arch, c.dtype) for c in cells if c.family == "a"} == {("llama", "bfloat16"), ("llama", "float16")}
    assert {(c.arch, c.dtype) for c in cells if c.family == "b"} == {("mixtral", "float32"), ("phi3", "float32")}
    assert {c.arch for c in Coverage.load(path).cells(formats=["fp8-block"], archs=["phi3"])} == {"phi3"}


UNALIGNED = [c for c in CELLS if c.family == "unaligned-sizes"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_unaligned_sizes_family_frees_head_widths_and_keeps_the_kernels_inputs(data):
    """Its cells are GPTQ's and AWQ's (the formats whose draws keep the kernel's multiple first);
    every recipe keeps hidden_size a multiple of 32 (vLLM's CPU kernel takes q/k/v's and gate/up's
    inputs), the attention width and intermediate size whole 8-code words."""
    assert {c.format for c in UNALIGNED} == {"gptq", "awq"}
    cell = data.draw(st.sampled_from(UNALIGNED))
    config = data.draw(recipes((cell.format,), (cell.arch,), COVERAGE.force(cell))).config
    width = config["num_attention_heads"] * config["head_dim"]
    assert config["hidden_size"] % 32 == 0 and width % 8 == 0 and config["intermediate_size"] % 8 == 0, config


@pytest.mark.parametrize("cell", UNALIGNED[:4], ids=lambda c: c.name)
def test_an_unaligned_sizes_cells_first_visit_draws_kv_outputs_that_are_not_whole_words(cell):
    """A visit's first example is its simplest: grouped key-value heads, k/v outputs not whole words,
    gate/up outputs not multiples of 16."""
    from hypothesis import find

    simplest = find(recipes((cell.format,), (cell.arch,), COVERAGE.force_on_visit(cell, 0)), lambda r: True).config
    assert simplest["num_key_value_heads"] < simplest["num_attention_heads"], simplest
    assert simplest["num_key_value_heads"] * simplest["head_dim"] % 8 and simplest["intermediate_size"] % 16, simplest


def test_a_family_spans_its_own_formats_and_names_what_its_examples_check(tmp_path):
    path = tmp_path / "coverage.toml"
    path.write_text(
        'archs = ["llama"]\ndtypes = ["bfloat16"]\n[family.a]\nforce = {}\n'
        '[family.b]\nforce = {}\nformats = ["gptq", "fp8-block"]\nrelations = ["sentinel"]\n'
        'variants = ["transformers[dtype=float16]"]\n'
    )
    coverage = Coverage.load(path)
    assert {c.format for c in coverage.cells() if c.family == "b"} == {"gptq", "fp8-block"}
    assert {"gptq", "fp8-block", "ct-int4"} < {c.format for c in coverage.cells() if c.family == "a"}
    assert coverage.families["b"].relations == ("sentinel",)
    assert coverage.families["b"].variants == ("transformers[dtype=float16]",)
    assert coverage.families["a"].relations == coverage.families["a"].variants == ()


@pytest.mark.parametrize(
    "force, fmt, arch, applies",
    [
        ('"sizes.alignment" = ["blocks"]', "ct-fp8-block", "llama", True),  # 128 x 128 blocks
        ('"sizes.alignment" = ["blocks"]', "ct-fp8-tensor", "llama", False),  # one scale per tensor
        ('"sizes.alignment" = ["free"]', "gptq", "llama", True),  # vLLM's CPU kernel's multiple of 32
        ('"sizes.alignment" = ["free"]', "ct-fp8-block", "llama", False),  # no kernel multiple to free
        ('"sizes.expert_widths" = ["free"]', "ct-fp8-tensor", "qwen3_moe", True),
        ('"sizes.expert_widths" = ["free"]', "ct-fp8-tensor", "llama", False),  # no experts
    ],
)
def test_a_sizes_family_applies_where_the_draws_hold_what_it_frees_or_forces(tmp_path, force, fmt, arch, applies):
    path = tmp_path / "coverage.toml"
    path.write_text(f'archs = ["{arch}"]\ndtypes = ["bfloat16"]\n[family.a]\nforce = {{ {force} }}\n')
    assert bool(Coverage.load(path).cells(formats=[fmt])) is applies
