"""Every variant the strategies promise is reachable (one `find` each), and what they build is valid."""

from __future__ import annotations

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from harness.campaign.strategies import (
    BLOCK_EDGES,
    DIMENSION_CLASSES,
    ENGINE_HEAD_DIMS,
    GROUPED_MM_MULTIPLE,
    HEAD_COUNT_RULES,
    HEAD_COUNTS,
    KERNEL_COLUMN_MULTIPLES,
    MAX_LAYERS,
    MAX_SHARDS,
    MOE_KERNEL_COLUMN_MULTIPLE,
    architectures,
    block_shapes,
    column_multiple,
    dimension_class,
    dimensions,
    feasible_classes,
    format_knobs,
    layouts,
    perturbations,
    recipes,
    scale_grids,
    whole_blocks_loadable,
)
from harness.checkpoints.architectures import ARCHITECTURES
from harness.checkpoints.recipe import LAYOUT_CHOICES, PERTURB_CHOICES, PERTURB_DEFAULTS, VLM_PREFIX
from harness.checkpoints.writer import generate
from harness.formats import FORMAT_NAMES, get_format

#: no shrinking: a found example only has to exist, and shrinking recipes is the slow part
FIND = settings(max_examples=3000, phases=[Phase.generate], database=None)
BLOCK_FORMATS = tuple(n for n in FORMAT_NAMES if "block_rows" in get_format(n).knobs)
TRANSPOSABLE_FORMATS = tuple(n for n in FORMAT_NAMES if "scale_layout" in get_format(n).knobs)
CONVENTION_FORMATS = tuple(n for n in FORMAT_NAMES if "global_scale_convention" in get_format(n).knobs)
WHOLE_GROUP_FORMATS = tuple(n for n in FORMAT_NAMES if column_multiple(n) > 1)
KNOB_CHOICES = [
    (name, knob, choice)
    for name in FORMAT_NAMES
    for knob, spec in get_format(name).knobs.items()
    for choice in spec.choices
]
PERTURB_VALUES = [
    (key, value)
    for key, default in PERTURB_DEFAULTS.items()
    for value in ((False, True) if isinstance(default, bool) else PERTURB_CHOICES[key])
]


def reach(strategy, condition):
    """An example of `strategy` meeting `condition`; fails the test when none is found."""
    __tracebackhide__ = True
    return find(strategy, condition, settings=FIND)


def grids_of(recipe):
    return list(scale_grids(recipe).values())


def shapes_of(recipe):
    return list(ARCHITECTURES[recipe.arch].projection_shapes(recipe.resolved().settings).values())


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format(name):
    reach(recipes(), lambda r: r.format == name)


@pytest.mark.parametrize("arch", tuple(ARCHITECTURES))
def test_every_architecture(arch):
    reach(recipes(), lambda r: r.arch == arch)


@pytest.mark.parametrize("tied", [False, True])
def test_tied_and_untied_embeddings(tied):
    reach(architectures(), lambda a: a[1]["tie_word_embeddings"] is tied)


@pytest.mark.parametrize("layers", range(1, MAX_LAYERS + 1))
def test_layer_counts(layers):
    reach(architectures(), lambda a: a[1]["num_hidden_layers"] == layers)


@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_llama_biases(attention_bias, mlp_bias):
    reach(architectures(("llama",)), lambda a: (a[1]["attention_bias"], a[1]["mlp_bias"]) == (attention_bias, mlp_bias))


def test_fully_biased_llama_biases_every_projection():
    name, config = reach(architectures(("llama",)), lambda a: a[1]["attention_bias"] and a[1]["mlp_bias"])
    arch = ARCHITECTURES[name]
    assert arch.biased_projections(arch.settings(config)) == set(arch.projection_shapes(arch.settings(config)))


@pytest.mark.parametrize("heads, kv_heads", HEAD_COUNTS)
def test_every_head_count(heads, kv_heads):
    """Multi-head and grouped-query attention."""
    reach(architectures(), lambda a: (a[1]["num_attention_heads"], a[1]["num_key_value_heads"]) == (heads, kv_heads))


@pytest.mark.parametrize("attention", ["any", "untied"])
def test_attention_widths_with_a_head_size_vllm_runs(attention):
    """head_dim 32 or 64 with a width other than hidden_size: vLLM's CPU attention runs it, and its
    Qwen2 misreads it (cases/known_issues.toml)."""
    reach(
        architectures(attention=attention),
        lambda a: (
            a[1]["head_dim"] in ENGINE_HEAD_DIMS
            and a[1]["num_attention_heads"] * a[1]["head_dim"] != a[1]["hidden_size"]
        ),
    )


MOE_ARCHS = tuple(name for name, arch in ARCHITECTURES.items() if arch.moe)


def contraction_sizes(arch_config):
    """Every size some MoE matmul contracts over: hidden, the dense and every expert width."""
    name, config = arch_config
    return [v for k, v in config.items() if k == "hidden_size" or k.endswith("intermediate_size")]


@pytest.mark.parametrize("runnable", [False, True])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_sizes_transformers_runs_and_sizes_it_refuses(arch, runnable):
    """Whole 16-byte rows (transformers' grouped_mm runs the experts, so the forward is judged)
    and other widths (its known refusal) are both drawn for every MoE architecture."""
    reach(
        architectures((arch,)),
        lambda a: all(s % GROUPED_MM_MULTIPLE == 0 for s in contraction_sizes(a)) is runnable,
    )


LOADABLE_WHOLE_BLOCKS = tuple(n for n in FORMAT_NAMES if whole_blocks_loadable(n))


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("name", LOADABLE_WHOLE_BLOCKS)
def test_formats_whose_partial_blocks_engines_refuse_also_draw_whole_blocks(name, whole, tmp_path):
    """ct-int4 writes a partial last group that compressed-tensors refuses (exact-or-refuse): its
    draws also keep every K a whole number of groups, checkpoints a correct engine loads exactly."""
    recipe = reach(
        recipes(formats=(name,)),
        lambda r: all(k % r.knobs["group_size"] == 0 for _, k in shapes_of(r)) is whole,
    )
    assert (generate(recipe, tmp_path / "checkpoint")["expectation"] == "exact") is whole


def test_integer_formats_are_those_whose_partial_groups_engines_may_refuse():
    """compressed-tensors' pack-quantized (ct 0.20 raises on a partial group) and GPTQ (a K of 129
    leaves a zero-padded qweight word its loaders do not allocate)."""
    assert set(LOADABLE_WHOLE_BLOCKS) == {"ct-int4", "ct-int8", "gptq"}


@pytest.mark.parametrize("name", sorted(KERNEL_COLUMN_MULTIPLES))
def test_int4_draws_shapes_vllms_cpu_kernel_runs_with_partial_groups_and_shapes_it_refuses(name):
    """GPTQ and AWQ draw every K a multiple of vLLM's CPU kernel's 32 (so vLLM loads and runs them)
    while some K leaves a partial last group (what a correct loader must load exactly), and also
    draw a K no such kernel takes (vLLM then `unsupported`, its loaders judged through stand-ins)."""
    multiple = KERNEL_COLUMN_MULTIPLES[name]
    group = lambda r: r.knobs["group_size"] if r.knobs["group_size"] > 0 else 2**20  # noqa: E731
    reach(
        recipes(formats=(name,)),
        lambda r: all(k % multiple == 0 for _, k in shapes_of(r)) and any(k % group(r) for _, k in shapes_of(r)),
    )
    reach(recipes(formats=(name,)), lambda r: any(k % multiple for _, k in shapes_of(r)))


@pytest.mark.parametrize("name", sorted(KERNEL_COLUMN_MULTIPLES))
def test_int4_moe_simplest_draw_has_the_widths_vllms_moe_methods_take(name):
    """An MoE architecture's simplest GPTQ/AWQ draw (a cell's first visit) keeps hidden_size and every
    expert width a multiple of 128 (Marlin's MoE condition), so vLLM builds its GPTQ/AWQ MoE methods
    rather than MoeWNA16's; other draws still reach widths it does not take."""
    recipe = find(recipes(formats=(name,), archs=("qwen3_moe",)), lambda r: True, settings=FIND)
    assert recipe.config["hidden_size"] % MOE_KERNEL_COLUMN_MULTIPLE == 0
    assert recipe.config["moe_intermediate_size"] % MOE_KERNEL_COLUMN_MULTIPLE == 0
    reach(recipes(formats=(name,), archs=("qwen3_moe",)), lambda r: r.config["hidden_size"] % 128 != 0)


@pytest.mark.parametrize("sparse_first", [True, False])
def test_a_one_layer_deepseek_draw_has_routed_experts_unless_told_to_keep_its_dense_first_layer(sparse_first):
    """A one-layer DeepSeek-V3 with the release's dense first layer has no routed experts; drawn
    sparse by default (every cell's simplest example judges its experts), dense where the layouts
    family asks for the release's layout (what vLLM loads where it has no kernel for the experts)."""
    arch = ARCHITECTURES["deepseek_v3"]
    _, config = reach(
        architectures(("deepseek_v3",), sparse_first=sparse_first), lambda a: a[1]["num_hidden_layers"] == 1
    )
    assert arch.is_sparse(arch.settings(config), 0) is sparse_first
    _, config = reach(
        architectures(("deepseek_v3",), sparse_first=sparse_first), lambda a: a[1]["num_hidden_layers"] == 2
    )
    settings_ = arch.settings(config)
    assert (arch.is_sparse(settings_, 0), arch.is_sparse(settings_, 1)) == (False, True)  # the release's layout


@given(data=st.data())
def test_an_untied_attention_width_is_never_hidden_size(data):
    _, config = data.draw(architectures(attention="untied"))
    assert config["num_attention_heads"] * config["head_dim"] != config["hidden_size"]


def test_attention_width_tied_to_hidden_size():
    reach(architectures(), lambda a: a[1]["num_attention_heads"] * a[1]["head_dim"] == a[1]["hidden_size"])


@pytest.mark.parametrize("block", BLOCK_EDGES)
@pytest.mark.parametrize("kind", DIMENSION_CLASSES)
def test_every_dimension_class(block, kind):
    size = reach(dimensions(block), lambda s: dimension_class(s, block) == kind)
    assert {
        "smaller-than-block": size < block,
        "block-plus-one": size == block + 1,
        "grid-divides": size > block and size % block and size % -(-size // block) == 0,
        "blocks-plus-partial": size > 2 * block and size % block,
        "exact-multiple": size % block == 0,
    }[kind]


@given(block=st.sampled_from(BLOCK_EDGES), multiple_of=st.sampled_from((1, 2, 4, 8, 16)), data=st.data())
def test_dimensions_are_multiples_in_a_feasible_class(block, multiple_of, data):
    size = data.draw(dimensions(block, multiple_of))
    assert size >= 1 and size % multiple_of == 0
    assert dimension_class(size, block) in feasible_classes(block, multiple_of)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("size", ["hidden_size", "intermediate_size"])
@pytest.mark.parametrize("kind", DIMENSION_CLASSES)
def test_sizes_of_every_class_against_the_format_block(name, size, kind):
    edge = "block_cols" if size == "hidden_size" else "block_rows"
    reach(recipes((name,)), lambda r: dimension_class(r.config[size], r.knobs[edge]) == kind)


@pytest.mark.parametrize("name", WHOLE_GROUP_FORMATS)
@pytest.mark.parametrize("groups", ["one", "several"])
def test_whole_group_formats_get_one_and_several_groups(name, groups):
    """Where K must be whole groups (NVFP4), both a single group and several are drawn."""
    multiple = column_multiple(name)
    reach(recipes((name,)), lambda r: (r.config["hidden_size"] == multiple) == (groups == "one"))


@pytest.mark.parametrize("name", WHOLE_GROUP_FORMATS)
def test_whole_group_formats_still_get_rows_of_any_count(name):
    """Only K must be whole groups: some projection's N (k_proj, v_proj) is not a multiple."""
    multiple = column_multiple(name)
    reach(recipes((name,)), lambda r: any(rows % multiple for rows, _ in shapes_of(r)))


def test_nvfp4_needs_whole_groups():
    assert {"ct-nvfp4", "ct-nvfp4a16", "modelopt-nvfp4"} <= set(WHOLE_GROUP_FORMATS)


@pytest.mark.parametrize("name, knob, choice", KNOB_CHOICES, ids=[f"{n}-{k}-{c}" for n, k, c in KNOB_CHOICES])
def test_every_knob_choice(name, knob, choice):
    reach(format_knobs(name), lambda k: k[knob] == choice)


@pytest.mark.parametrize("name", CONVENTION_FORMATS)
def test_swapped_nvfp4_global_scale_convention(name):
    reach(recipes((name,)), lambda r: r.knobs["global_scale_convention"] == "swapped")


def test_every_nvfp4_format_can_swap_its_convention():
    assert {"ct-nvfp4", "ct-nvfp4a16", "modelopt-nvfp4"} <= set(CONVENTION_FORMATS)


@pytest.mark.parametrize("square", [False, True])
def test_square_and_non_square_blocks(square):
    reach(block_shapes(), lambda b: (b[0] == b[1]) is square)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_default_block_128(name):
    reach(format_knobs(name), lambda k: k["block_rows"] == k["block_cols"] == 128)


@given(knobs=format_knobs("fp8-block"))
def test_scalar_and_one_element_block_styles_get_square_blocks(knobs):
    assert knobs["block_size_style"] == "list" or knobs["block_rows"] == knobs["block_cols"]


@pytest.mark.parametrize("name", TRANSPOSABLE_FORMATS)
@pytest.mark.parametrize("grid", ["square > 1x1", "non-square", "all square, some > 1x1"])
def test_transposed_square_and_non_square_grids(name, grid):
    """Transposing a non-square grid makes it misfit (refuse or recover); a square one > 1x1
    moves scales undetectably; with every grid square the whole checkpoint stays exact."""
    condition = {
        "square > 1x1": lambda grids: any(r == c > 1 for r, c in grids),
        "non-square": lambda grids: any(r != c for r, c in grids),
        "all square, some > 1x1": lambda grids: all(r == c for r, c in grids) and any(r > 1 for r, _ in grids),
    }[grid]
    reach(recipes((name,)), lambda r: r.knobs["scale_layout"] == "transposed" and condition(grids_of(r)))


SHARDINGS = [(1, False)] + [(shards, split) for shards in range(2, MAX_SHARDS + 1) for split in (False, True)]


@pytest.mark.parametrize("shards, split_scale", SHARDINGS, ids=[f"{n}{'-split' if s else ''}" for n, s in SHARDINGS])
def test_shards_and_split_scales(shards, split_scale):
    """1 shard is a single model.safetensors; a split puts scales in another shard than their weights."""
    reach(layouts(), lambda layout: (layout["shards"], layout["split_scale"]) == (shards, split_scale))


LAYOUT_VALUES = [(key, value) for key in ("key_prefix", "dtype") for value in LAYOUT_CHOICES[key]]


@pytest.mark.parametrize("key, value", LAYOUT_VALUES, ids=[f"{k}-{v}" for k, v in LAYOUT_VALUES])
def test_every_layout_choice(key, value):
    reach(layouts(), lambda layout: layout[key] == value)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_vlm_prefix_with_every_format(name):
    reach(recipes((name,)), lambda r: r.layout["key_prefix"] == VLM_PREFIX)


@pytest.mark.parametrize("key, value", PERTURB_VALUES, ids=[f"{k}-{v}" for k, v in PERTURB_VALUES])
def test_every_perturbation(key, value):
    reach(perturbations(), lambda p: p[key] == value)


def test_unperturbed_recipes():
    reach(perturbations(), lambda p: p == PERTURB_DEFAULTS)


@given(recipe=recipes())
def test_recipes_are_valid(recipe):
    """Built valid: resolves, every K a multiple the format accepts, head_dim even, split only with shards."""
    resolved = recipe.resolved()
    multiple = column_multiple(recipe.format)
    for rows, cols in shapes_of(recipe):
        assert rows >= 1 and cols % multiple == 0, (rows, cols)
    assert resolved.settings["head_dim"] % 2 == 0
    assert resolved.layout["shards"] >= 2 or not resolved.layout["split_scale"]
    assert all(r >= 1 and c >= 1 for r, c in grids_of(recipe))


@settings(max_examples=10)
@given(recipe=recipes(formats=("ct-mxfp4",), archs=("deepseek_v3",)))
def test_deepseeks_lora_ranks_are_whole_groups_where_the_format_refuses_a_partial_one(recipe):
    """q_lora_rank is q_b_proj's input width: its default 48 is no whole number of MXFP4's groups of 32."""
    assert all(cols % column_multiple("ct-mxfp4") == 0 for _, cols in shapes_of(recipe))


@settings(max_examples=30, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(
    recipe=recipes(
        formats=("ct-fp8-block",),
        archs=("llama",),
        force={"layout.producer_config": ("modelopt",), "sizes.alignment": ("blocks",)},
    )
)
def test_whole_blocks_under_a_producers_config_are_the_blocks_that_producer_writes(recipe):
    """ModelOpt's FP8_PB_WO is 128 x 128 whatever block the knobs drew (fit_recipe gives the recipe
    ModelOpt's after the sizes): under whole "blocks" every K is whole blocks of 128, so vLLM reads
    the weights rather than refusing a partial input block first (the producer-whole-blocks family)."""
    assert recipe.layout["producer_config"] == "modelopt" and recipe.knobs["block_cols"] == 128
    assert all(k % 128 == 0 for _, k in shapes_of(recipe)), shapes_of(recipe)


@pytest.mark.parametrize("name", sorted(KERNEL_COLUMN_MULTIPLES))
def test_kernel_alignment_starts_from_partial_groups_the_kernel_takes(name):
    """GPTQ's simplest draw keeps every K whole groups (a correct engine may refuse a partial one);
    under sizes.alignment "kernel" with groups of 64 (the int4-partial-groups family) the simplest
    GPTQ or AWQ draw keeps every K the kernel's 32-multiple with a partial last group, and every
    draw keeps the multiple."""
    force = {"knobs.group_size": (64,)}
    kept = find(recipes(formats=(name,), archs=("llama",), force=force), lambda r: True, settings=FIND)
    kernel = recipes(formats=(name,), archs=("llama",), force={**force, "sizes.alignment": ("kernel",)})
    freed = find(kernel, lambda r: True, settings=FIND)
    assert all(k % 64 == 0 for _, k in shapes_of(kept)) is whole_blocks_loadable(name), shapes_of(kept)
    assert any(k % 64 for _, k in shapes_of(freed)), shapes_of(freed)

    @settings(max_examples=20, deadline=None, phases=[Phase.generate])
    @given(kernel)
    def every_k_the_kernels_multiple(recipe):
        assert all(k % KERNEL_COLUMN_MULTIPLES[name] == 0 for _, k in shapes_of(recipe)), shapes_of(recipe)

    every_k_the_kernels_multiple()


def test_free_expert_widths_start_from_rows_grouped_mm_refuses():
    """A mixture's simplest draw keeps whole 16-byte rows (transformers runs its experts); with
    sizes.expert_widths free (the odd-expert-widths family) the simplest one is a width it refuses."""
    kept = find(architectures(("qwen3_moe",)), lambda a: True, settings=FIND)
    freed = find(architectures(("qwen3_moe",), grouped_mm_rows=False), lambda a: True, settings=FIND)
    assert all(s % GROUPED_MM_MULTIPLE == 0 for s in contraction_sizes(kept))
    assert any(s % GROUPED_MM_MULTIPLE for s in contraction_sizes(freed)), freed


@pytest.mark.parametrize("heads", sorted(HEAD_COUNT_RULES))
def test_a_head_count_rule_keeps_its_head_counts_and_reaches_each(heads):
    """ "several" heads (tensor parallelism splits them), "grouped" key-value heads (k/v outputs
    narrower than q's), "ungrouped" ones: every draw keeps to the rule, every count it keeps is drawn."""
    rule = HEAD_COUNT_RULES[heads]
    counts = lambda a: (a[1]["num_attention_heads"], a[1]["num_key_value_heads"])  # noqa: E731
    strategy = architectures(("llama", "gpt_oss"), head_rule=heads)
    for count in (h for h in HEAD_COUNTS if rule(*h)):
        reach(strategy, lambda a, count=count: counts(a) == count)

    @settings(max_examples=30, deadline=None, phases=[Phase.explicit, Phase.generate])
    @given(strategy)
    def kept(arch_config):
        assert rule(*counts(arch_config))

    kept()
