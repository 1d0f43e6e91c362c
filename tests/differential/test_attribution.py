"""Known-issue attribution by mechanism (harness/differential/known_issues.py): an entry's
preconditions (`when`) must hold for the checkpoint and module, and a weight finding must equal
the entry's predicted misreading (harness/differential/misreadings.py); a message or a kind alone
excuses nothing."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.core.findings import Finding
from harness.differential.known_issues import KnownIssues
from harness.differential.misreadings import REGISTRY
from harness.differential.preconditions import Predicate, alignment_facts, known_names
from harness.differential.runner import EngineSession, Judgement, evaluate, judge_held_weights

GRID_ISSUE = "transformers-fp8-block-grid-inferred-from-shape"
HEAD_DIM_ISSUE = "vllm-qwen2-ignores-head-dim"
#: the grid issue's reproducer: 160 rows, blocks of 128 (partial blocks that divide by the ceil grid)
GRID_REPRODUCER = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 1}
ENTRY = """
[[issue]]
id = "made-up"
engine = "transformers"
versions = ">=5.0"
formats = ["fp8-block"]
kind = "weight-mismatch"
reason = "a test entry"
reproducer = {{ format = "fp8-block", arch = "llama" }}
{extra}
"""


def load_entry(tmp_path, extra: str) -> KnownIssues:
    path = tmp_path / "known_issues.toml"
    path.write_text(ENTRY.format(extra=extra))
    return KnownIssues.load(path)


def holds(text: str, **context) -> bool:
    return Predicate.parse(text, "test", known_names()).holds(context)


# --- the evaluator ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, context, expected",
    [
        (
            "head_dim != hidden_size / num_attention_heads",
            {"head_dim": 64, "hidden_size": 64, "num_attention_heads": 2},
            True,
        ),
        (
            "head_dim != hidden_size / num_attention_heads",
            {"head_dim": 32, "hidden_size": 64, "num_attention_heads": 2},
            False,
        ),
        (
            "hidden_size % 128 != 0 or intermediate_size % 128 != 0",
            {"hidden_size": 128, "intermediate_size": 160},
            True,
        ),
        (
            "hidden_size % 128 != 0 or intermediate_size % 128 != 0",
            {"hidden_size": 256, "intermediate_size": 384},
            False,
        ),
        ("dtype == 'float16' and scale_dtype == 'float32'", {"dtype": "float16", "scale_dtype": "float32"}, True),
        ("dtype in ('float16', 'float32')", {"dtype": "bfloat16"}, False),
        ("dtype not in ['bfloat16']", {"dtype": "float32"}, True),
        ("not input_scale", {"input_scale": False}, True),
        ("partial", {"partial": True}, True),
        ("rows % ((rows + block_rows - 1) // block_rows) == 0", {"rows": 160, "block_rows": 128}, True),
        ("rows % ((rows + block_rows - 1) // block_rows) == 0", {"rows": 160, "block_rows": 64}, False),
        ("-rows + 2 * rows - 1 < rows <= rows", {"rows": 3}, True),
        ("partial == True", {"partial": False}, False),
    ],
)
def test_predicates_evaluate_as_python_would(text, context, expected):
    assert holds(text, **context) is expected


@pytest.mark.parametrize(
    "text, context",
    [
        ("head_dim != hidden_size / num_attention_heads", {"hidden_size": 64, "num_attention_heads": 2}),
        ("nonfinite_scale != 'none'", {}),  # not a generated checkpoint: no recipe
        ("not input_scale", {}),  # `not` of a missing name is false too, not true
        ("hidden_size / num_attention_heads > 1", {"hidden_size": 64, "num_attention_heads": 0}),
        ("hidden_size - model_type == 1", {"hidden_size": 64, "model_type": "llama"}),  # does not compute
    ],
)
def test_a_name_the_context_lacks_or_values_that_do_not_compute_make_it_false(text, context):
    assert holds(text, **context) is False


def test_or_is_decided_by_a_present_name():
    assert holds("hidden_size % 128 != 0 or intermediate_size % 128 != 0", hidden_size=64)


@pytest.mark.parametrize(
    "text, what",
    [
        ("len(model_type) > 1", "Call"),
        ("config.hidden_size > 1", "Attribute"),
        ("model_type[0] == 'l'", "Subscript"),
        ("(lambda: True)()", "Call"),
        ("lambda: True", "Lambda"),
        ("hidden_size ** 2 > 1", "BinOp"),
        ("[x for x in (1, 2)]", "ListComp"),
        ("__import__('os')", "Call"),
        ("None == None", "None"),
        ("(hidden_size, 1)", "outside `in`"),
        ("hidden_size if partial else 1", "IfExp"),
        ("(hidden_size := 1) > 0", "NamedExpr"),
        ("hidden_size ==", "not an expression"),
    ],
)
def test_a_forbidden_construct_fails_when_the_file_is_loaded(tmp_path, text, what):
    with pytest.raises(HarnessError, match="issue made-up") as raised:
        load_entry(tmp_path, f"when = [{text!r}]")
    assert what in str(raised.value)


def test_a_misspelt_name_fails_when_the_file_is_loaded(tmp_path):
    with pytest.raises(HarnessError, match="issue made-up.*hiden_size"):
        load_entry(tmp_path, 'when = ["hiden_size % 128 != 0"]')


def test_an_unknown_misreading_fails_when_the_file_is_loaded(tmp_path):
    with pytest.raises(HarnessError, match="issue made-up.*unknown misreading 'grid-twice'"):
        load_entry(tmp_path, 'misreading = "grid-twice"')
    with pytest.raises(HarnessError, match="not defined for format"):
        load_entry(tmp_path, 'misreading = "ct-fp8-scale-cast-to-model-dtype"')
    with pytest.raises(HarnessError, match="unknown key.*partial_blocks"):
        load_entry(tmp_path, "partial_blocks = true")


# --- the entries ------------------------------------------------------------------------------


def test_every_entry_states_its_mechanism():
    for issue in KnownIssues.load().issues:
        assert issue.when, f"{issue.id}: no preconditions (`when`)"
    misreadings = {i.misreading for i in KnownIssues.load().issues if i.misreading}
    assert misreadings == set(REGISTRY), "every registered misreading is some entry's, and only those"


def generated(tmp_path, name, fmt, arch, **config):
    directory = tmp_path / name
    generate(Recipe(format=fmt, arch=arch, config={"num_hidden_layers": 1, **config}), directory)
    return directory


@pytest.mark.parametrize(
    ("fmt", "arch", "config", "knobs", "inputs", "outputs"),
    [
        # llama: inputs 128 (hidden, q heads) and 160 (intermediate: 32 | 160); outputs 64 (k/v), 128, 160
        ("gptq", "llama", {}, {}, 32, 32),
        # DeepSeek's latent attention: its kv_a / kv_b and q_b widths, whatever config fields name them
        ("gptq", "deepseek_v3", {}, {"desc_act": True, "group_size": 32}, 16, 16),
        ("awq", "qwen3_moe", {"moe_intermediate_size": 24}, {"group_size": 32}, 8, 8),
    ],
)
def test_alignment_facts_read_every_quantized_linear_alike_with_or_without_the_manifest(
    tmp_path, fmt, arch, config, knobs, inputs, outputs
):
    """input_alignment / output_alignment: the largest power of two dividing every quantized Linear's
    widths, from the generator's manifest and, for a checkpoint it did not write (no manifest), from
    the GPTQ/AWQ tensors' headers: the same numbers."""
    directory = tmp_path / "written"
    generate(Recipe(format=fmt, arch=arch, config={"num_hidden_layers": 1, **config}, knobs=knobs), directory)
    written = alignment_facts(directory)
    assert written == {"input_alignment": inputs, "output_alignment": outputs}
    (directory / "harness_manifest.json").unlink()
    assert alignment_facts(directory) == written


def test_alignment_facts_skip_a_module_the_manifest_gives_no_shape(tmp_path):
    """An orphan scale's module (a scale for a module the model lacks) has no shape: the others count."""
    recipe = Recipe(
        format="gptq", arch="llama", config={"num_hidden_layers": 1}, perturb={"disagreement": "orphan-scale"}
    )
    generate(recipe, tmp_path)
    assert alignment_facts(tmp_path) == {"input_alignment": 32, "output_alignment": 32}


def test_head_dim_message_without_its_precondition_is_new(tmp_path):
    """vLLM's Qwen2 head_dim issue excuses a slicing error only where head_dim != hidden / heads:
    the same message on a checkpoint where they agree is another mechanism, so new."""
    known = KnownIssues.load()

    def finding(directory):
        return Finding(
            engine="vllm",
            engine_version="0.32.0",
            kind="load-error",
            format="ct-fp8-channel",
            message="RuntimeError: start (0) + length (72) exceeds dimension size (32)",
            arch="qwen2",
            checkpoint=str(directory),
        )

    plain = generated(tmp_path, "plain", "ct-fp8-channel", "qwen2")  # 128 / 4 heads = head_dim 32
    assert known.match(finding(plain)) is None
    reproducer = known.by_id(HEAD_DIM_ISSUE).reproducer["config"]
    wide = generated(tmp_path, "wide", "ct-fp8-channel", "qwen2", **reproducer)
    assert known.match(finding(wide)) == HEAD_DIM_ISSUE


@pytest.mark.parametrize("prefix", ["model.language_model.", "model."])
def test_accepting_a_prefixed_checkpoint_that_omits_a_scale_is_the_prefix_issue_only_with_the_prefix(prefix, tmp_path):
    """transformers reads no key under 'model.language_model.', so a prefixed checkpoint that must
    be refused for an omitted scale too loads all the same: the prefix issue. Without the prefix,
    accepting it is new."""
    directory = tmp_path / "checkpoint"
    recipe = Recipe("modelopt-nvfp4", "qwen2", config={"num_hidden_layers": 1}, layout={"key_prefix": prefix})
    recipe.perturb["disagreement"] = "missing-scale"
    manifest = generate(recipe, directory)
    notes = [f"{m}: {n}" for m, info in manifest["modules"].items() for n in info["notes"]] + manifest["notes"]
    accepted = Finding(
        engine="transformers",
        engine_version="5.23.0",
        kind="accepted-invalid",
        format="modelopt-nvfp4",
        message="loaded a checkpoint that must be refused: " + "; ".join(notes),  # as the runner words it
        arch="qwen2",
        checkpoint=str(directory),
    )
    expected = "transformers-vlm-prefix-loads-random-weights" if prefix != "model." else None
    assert KnownIssues.load().match(accepted) == expected, accepted.message


@pytest.mark.parametrize(
    "engine, version, issue",
    [
        ("compressed-tensors", "0.20.0", "ct-nvfp4-decompresses-to-bfloat16"),
        ("transformers", "5.23.0", "transformers-ct-nvfp4-non-bfloat16-forward-dtype"),
    ],
)
@pytest.mark.parametrize(
    "dtype, message",
    [
        ("float16", "RuntimeError: self and mat2 must have the same dtype, but got Half and BFloat16"),
        ("float16", "RuntimeError: expected m1 and m2 to have the same dtype, but got: c10::Half != c10::BFloat16"),
        ("float32", "RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"),
    ],
)
def test_nvfp4_bfloat16_forward_failures_in_the_words_seen(tmp_path, engine, version, issue, dtype, message):
    """Both spellings of the forward's dtype mismatch after NVFP4 decompression to bfloat16; the
    same message in a bfloat16 model is another mechanism."""
    known = KnownIssues.load()

    def finding(directory, dtype):
        return Finding(
            engine,
            version,
            "load-error",
            "ct-nvfp4a16",
            f"after loading: {message}",
            "llama",
            dtype,
            checkpoint=str(directory),
        )

    directory = tmp_path / dtype
    generate(
        Recipe(format="ct-nvfp4a16", arch="llama", config={"num_hidden_layers": 1}, layout={"dtype": dtype}), directory
    )
    assert known.match(finding(directory, dtype)) == issue
    bf16 = generated(tmp_path, "bf16", "ct-nvfp4a16", "llama")
    assert known.match(finding(bf16, "bfloat16")) is None


# --- predicted misreadings: the grid issue and a double that applies every FP8 scale twice ------


def transformers_findings(directory, held, tmp_path, version="5.23.0") -> list[Finding]:
    """The findings the runner makes of `held`, as if transformers `version` held it."""
    session = EngineSession(["transformers"], tmp_path / "work")
    session.versions["transformers"] = version
    judgement = Judgement.of(directory, session)
    judge_held_weights(judgement, "transformers", held)
    return judgement.result.findings + [
        judgement.finding("transformers", "logprobs", "max |delta logprob| 3 > 0.25")  # its consequence
    ]


@pytest.fixture(scope="module")
def grid_reproducer(tmp_path_factory):
    return generated(tmp_path_factory.mktemp("grid"), "checkpoint", "fp8-block", "qwen2", **GRID_REPRODUCER)


def test_double_scaled_weights_are_new_on_the_grid_issues_reproducer(grid_reproducer, tmp_path):
    """The injected bug (every FP8 scale applied twice) on the checkpoint where transformers' grid
    bug applies: the weights are wrong, but not as the grid bug reads them, so nothing is known."""
    pytest.importorskip("transformers")  # the double's model class
    from tests.doubles.buggy_engines import DoubleScaleEngine

    known = KnownIssues.load()
    assert known.by_id(GRID_ISSUE).applies_to("transformers", "5.23.0")
    engine = DoubleScaleEngine()
    engine.load(str(grid_reproducer))
    held = {name: tensor.detach() for name, tensor in engine.weights().items()}
    findings = transformers_findings(grid_reproducer, held, tmp_path)
    known.annotate(findings)
    weights = [f for f in findings if f.kind == "weight-mismatch"]
    assert len(weights) == 7, [f.message for f in findings]  # every projection: scale^2 != scale
    assert all(f.known_issue is None for f in findings), [(f.kind, f.known_issue) for f in findings]
    # hidden_size 64 < 128: every projection has a partial block, so the grid issue's preconditions
    # hold on each, and the reader is told why it does not explain them
    for item in weights:
        assert item.metrics["misreadings"]["fp8-block-grid-from-shape"]["equal"] is False
        assert item.metrics["attribution"].startswith(f"meets {GRID_ISSUE}'s preconditions, but the values differ")


def test_the_grid_misreading_itself_is_attributed(grid_reproducer, tmp_path):
    """Held values equal to the predicted misreading on the partial modules: the grid issue, and
    the logit finding inherits it."""
    known = KnownIssues.load()
    judgement = Judgement.of(grid_reproducer, EngineSession(["transformers"], tmp_path / "predict"))
    held = dict(judgement.truth)
    for name in judgement.truth:
        if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            held[name] = judgement.misreadings.predict("fp8-block-grid-from-shape", name, "bfloat16").values
    findings = transformers_findings(grid_reproducer, {n: t.float() for n, t in held.items()}, tmp_path)
    known.annotate(findings)
    assert [f.kind for f in findings].count("weight-mismatch") == 3
    assert {f.known_issue for f in findings} == {GRID_ISSUE}
    # outside the version range the same values are new
    old = transformers_findings(grid_reproducer, {n: t.float() for n, t in held.items()}, tmp_path / "old", "5.9.0")
    known.annotate(old)
    assert {f.known_issue for f in old} == {None}


@pytest.mark.slow
@pytest.mark.needs_engine("transformers")
def test_real_transformers_on_the_grid_reproducer_is_the_grid_issue(engine_session, grid_reproducer):
    """End to end with every entry loaded: real transformers' weights equal the predicted misreading,
    and the modules it reads right run unquantized activations (the activation probe, in bfloat16)."""
    result = evaluate(grid_reproducer, engine_session, KnownIssues.load(), ["reference", "transformers"])
    findings = [f for f in result.findings if f.engine == "transformers"]
    weights = [f for f in findings if f.kind == "weight-mismatch"]
    assert weights and all(f.metrics["misreadings"]["fp8-block-grid-from-shape"]["equal"] for f in weights)
    assert {f.known_issue for f in weights} == {GRID_ISSUE}
    others = {f.known_issue for f in findings if f.kind != "weight-mismatch"}
    assert others <= {"transformers-fp8-block-cpu-activations-unquantized"}, [(f.kind, f.message) for f in findings]


def test_the_grouped_mm_precondition_is_what_torch_refuses():
    """The entry's `when` against torch's own CPU kernel: over contraction widths 1..40 and the
    three model dtypes, the predicate holds exactly where _grouped_mm refuses the strides. A torch
    without _grouped_mm fails here: the entry's mechanism would then be gone."""
    import torch

    from harness.checkpoints.architectures import architecture_for
    from harness.differential.preconditions import derived_facts

    grouped_mm = torch._grouped_mm
    issue = next(i for i in KnownIssues.load().issues if i.id == "transformers-moe-grouped-mm-odd-width-cpu")
    key = architecture_for("qwen3_moe").moe.intermediate_key
    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
        for width in range(1, 41):
            tokens, weights = torch.randn(4, width, dtype=dtype), torch.randn(2, 8, width, dtype=dtype)
            try:
                grouped_mm(tokens, weights.transpose(-2, -1), offs=torch.tensor([2, 4], dtype=torch.int32))
                refused = False
            except RuntimeError as error:
                assert "16 bytes" in str(error)
                refused = True
            config = {"model_type": "qwen3_moe", "hidden_size": 64, key: width}
            context = config | {"dtype": dtype_name} | derived_facts(config, dtype_name)
            assert all(p.holds(context) for p in issue.when) == refused, (dtype_name, width)


def test_the_float16_cast_misreading_predicts_plain_tensors_too(tmp_path):
    """`model-cast-to-float16` (auto-round serving a model in float16): every weight, stored
    unquantized or not, is the checkpoint's value rounded to float16; for a float16 model it
    predicts nothing."""
    from harness.checkpoints.reader import Checkpoint
    from harness.differential.misreadings import CheckpointMisreadings
    from harness.fixes._shared import SkipTensor
    from harness.oracle.reference import dequantize_checkpoint

    recipe = Recipe(format="awq", arch="llama", config={"num_hidden_layers": 1}, knobs={"group_size": 32})
    recipe.layout = {"producer_config": "auto-round", "dtype": "float32"}
    generate(recipe, tmp_path)
    misreadings = CheckpointMisreadings(tmp_path, "awq")
    checkpoint, truth = Checkpoint(tmp_path), dict(dequantize_checkpoint(tmp_path))
    for name in ("model.norm.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        prediction = misreadings.predict("model-cast-to-float16", name, "float32")
        expected = truth[name].to(torch.float16).to(torch.float64)
        assert prediction.dtype == "float16" and torch.equal(prediction.values, expected)
        assert not torch.equal(prediction.values, truth[name])  # float32 values float16 cannot hold
    assert torch.equal(truth["model.norm.weight"], checkpoint.tensor("model.norm.weight").double())
    with pytest.raises(SkipTensor, match="float16 model"):
        misreadings.predict("model-cast-to-float16", "model.norm.weight", "float16")


def test_an_engine_option_names_the_model_dtype_without_changing_the_checkpoints(tmp_path):
    """`dtype` in `when` stays the checkpoint's; `model_dtype` is the one the engine computes in (the
    finding's): a float16 flush entry holds for transformers[dtype=float16] on a bfloat16 checkpoint
    of float32 scales, and not for the plain engine on it."""
    from harness.differential.preconditions import checkpoint_context, module_context

    directory = tmp_path / "c"
    recipe = Recipe(format="ct-fp8-channel", arch="llama", config={"num_hidden_layers": 1})
    recipe.knobs["scale_dtype"] = "float32"
    generate(recipe, directory)
    context = checkpoint_context(directory)
    assert context["dtype"] == "bfloat16" and context["weight_strategy"] == "channel" and context["weight_bits"] == 8
    issue = KnownIssues.load().by_id("transformers-ct-fp8-float32-scales-flushed-in-float16")
    for engine, dtype, holds in (("transformers[dtype=float16]", "float16", True), ("transformers", "bfloat16", False)):
        finding = Finding(
            engine=engine,
            engine_version="5.23.0",
            kind="weight-mismatch",
            format="ct-fp8-channel",
            message="x",
            dtype=dtype,
            checkpoint=str(directory),
        )
        facts = context | module_context(finding)
        assert facts["dtype"] == "bfloat16" and facts["model_dtype"] == dtype
        assert all(p.holds(facts) for p in issue.when) is holds


def test_a_compressed_tensors_configs_weight_bits_is_known_where_every_group_agrees():
    """`weight_bits` (num_bits of every config group's weights) lets a known issue say how many packed
    values a word holds (32 // weight_bits); config groups that disagree give none (the predicate is false)."""
    from harness.differential.preconditions import weight_scheme

    def config(*bits):
        groups = {f"group_{i}": {"weights": {"num_bits": b, "strategy": "group"}} for i, b in enumerate(bits)}
        return {"quant_method": "compressed-tensors", "config_groups": groups}

    assert weight_scheme(config(4)) == {"weight_strategy": "group", "weight_bits": 4}
    assert weight_scheme(config(4, 8)) == {"weight_strategy": "group"}
    assert weight_scheme({"quant_method": "compressed-tensors"}) == {}
