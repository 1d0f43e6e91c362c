"""Engine options (harness.engines.options): an engine loaded with a setting other than the
harness's default, `ENGINE[key=value,...]`, judged as its plain self is."""

from __future__ import annotations

import json

import pytest

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.commands.cli import main
from harness.core.errors import HarnessError
from harness.differential.known_issues import KnownIssues
from harness.engines import engine_spec
from harness.engines.options import base_engine, drawn_variant, split_engine
from harness.engines.vllm.engine import find_vllm_python

VLLM_PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None, reason="no vLLM interpreter: set HARNESS_VLLM_PYTHON, or build `tox -e vllm-cpu`"
)


def test_an_engine_with_options_names_its_plain_engine_and_carries_them_to_the_worker():
    assert split_engine("vllm[enforce_eager=false, kv_cache_dtype=FP8]") == (
        "vllm",
        {"enforce_eager": "false", "kv_cache_dtype": "fp8"},
    )
    assert split_engine("vllm") == ("vllm", {})
    assert base_engine("vllm[enforce_eager=false]") == "vllm"
    assert engine_spec("vllm[enforce_eager=false]") == "harness.engines.vllm.engine:VllmEngine[enforce_eager=false]"
    assert engine_spec("vllm") == "harness.engines.vllm.engine:VllmEngine"


@pytest.mark.parametrize(
    "name, words",
    [
        ("vllm[eager=false]", "vllm has no option 'eager'"),
        ("vllm[enforce_eager=maybe]", "enforce_eager='maybe' is not one of true, false"),
        ("vllm[enforce_eager]", "is not key=value"),
        ("compressed-tensors[enforce_eager=false]", "compressed-tensors takes no options"),
        ("transformers[enforce_eager=false]", "transformers has no option 'enforce_eager'"),
        ("vllm[dtype=float64]", "dtype='float64' is not one of auto, bfloat16, float16, float32"),
        ("vllm[enforce_eager=false", "options are written ENGINE[key=value,...]"),
    ],
)
def test_a_bad_option_is_one_line(name, words):
    with pytest.raises(HarnessError, match=words.replace("[", r"\[").replace("]", r"\]")) as raised:
        engine_spec(name)
    assert "\n" not in str(raised.value)


def test_a_bad_option_on_the_command_line_exits_2(tmp_path, capsys):
    directory = tmp_path / "c"
    generate(Recipe(format="ct-fp8-channel", arch="llama", config={"num_hidden_layers": 1}), directory)
    assert main(["compare", str(directory), "--engines", "reference,vllm[eager=false]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no option 'eager'" in err


def test_the_plain_engines_known_issues_apply_to_it():
    issue = KnownIssues.load().by_id("vllm-qwen2-ignores-head-dim")
    version = "0.32.0"
    assert issue.applies_to("vllm[enforce_eager=false]", version) and issue.applies_to("vllm", version)
    assert not issue.applies_to("transformers", version)


def test_a_campaign_draws_a_variant_on_every_nth_example_where_its_engine_runs():
    variants = ("vllm[enforce_eager=false]", "vllm[kv_cache_dtype=fp8]")
    engines = ["reference", "vllm"]
    drawn = [drawn_variant(example, 3, engines, variants) for example in range(1, 13)]
    assert drawn == [None, None, variants[0], None, None, variants[1], None, None, variants[0]] + [
        None,
        None,
        variants[1],
    ]
    assert drawn_variant(3, 3, ["reference", "transformers"], variants) is None  # vLLM is not in the run
    assert drawn_variant(3, 0, engines, variants) is None


def test_online_quantization_is_drawn_on_unquantized_examples_only():
    from harness.engines.options import FORMAT_VARIANTS, format_variant

    engines = ["reference", "vllm"]
    drawn = [format_variant(seen, "unquantized", engines, every=2) for seen in range(1, 7)]
    assert drawn == [
        None,
        *FORMAT_VARIANTS["unquantized"][:1],
        None,
        *FORMAT_VARIANTS["unquantized"][1:2],
        None,
        drawn[5],
    ]
    assert drawn[5] == FORMAT_VARIANTS["unquantized"][0]
    assert {format_variant(seen, "ct-fp8-channel", engines, every=1) for seen in range(1, 5)} == {None}
    assert format_variant(2, "unquantized", ["reference", "transformers"], every=2) is None


@needs_vllm
@pytest.mark.slow
def test_vllm_with_an_fp8_kv_cache_is_judged_or_unsupported_in_vllms_words(tmp_path, capsys):
    """Beside the plain engine, on one checkpoint: where this CPU has no FP8 KV cache (the AVX2
    kind), `unsupported` with vLLM's reason; where it has one, loaded and judged, in E4M3 and in
    E5M2, against the reference's model of the option: nothing new (E5M2's rounding toward zero
    goes beyond the bound in bfloat16 too: known issue vllm-cpu-fp8-kv-cache-rounds-toward-zero)."""
    directory = tmp_path / "c"
    generate(Recipe(format="ct-fp8-channel", arch="llama", config={"num_hidden_layers": 1}), directory)
    caches = ("vllm[kv_cache_dtype=fp8]", "vllm[kv_cache_dtype=fp8_e5m2]")
    main(["compare", str(directory), "--engines", ",".join(("reference", "vllm", *caches))])
    out = capsys.readouterr().out
    for engine in caches:
        line = next(line for line in out.splitlines() if line.lstrip().startswith(engine))
        assert "loaded" in line or "unsupported" in line, line
        if "unsupported" in line:
            assert "FP8 KV cache on CPU requires" in line, line
        else:  # judged against the reference's model of the option: the cache quantized at scale 1.0
            assert not [f for f in out.splitlines() if f"[NEW] {engine}" in f], out


def test_vllms_decline_of_an_e5m2_cache_for_an_fp8_checkpoint_is_unsupported_not_a_finding():
    """vLLM's attention layer declines `kv_cache_dtype=fp8_e5m2` wherever the checkpoint's method
    could carry FP8 KV scales (quant_method fp8, modelopt, compressed-tensors with a kv scheme): a
    documented limit of the option on any machine, said in its words (measured on a modelopt-fp8
    llama, session 34)."""
    from harness.engines.vllm.capability import declined_option

    error = ValueError("fp8_e5m2 kv-cache is not supported with fp8 checkpoints.")
    assert declined_option(error) == (
        "vLLM declines the option for this checkpoint: fp8_e5m2 kv-cache is not supported with fp8 checkpoints"
    )
    assert declined_option(ValueError("Failed to find a kernel that can implement the ScaledMM")) is None


@needs_vllm
@pytest.mark.nightly
def test_compiled_vllm_is_judged_like_eager_vllm(tmp_path, capsys):
    """vLLM with torch.compile (enforce_eager=false: 35 s to compile a 2-layer llama on 2 AVX2
    cores) holds, applies and computes what eager vLLM does, within the same bounds."""
    directory = tmp_path / "c"
    recipe = Recipe(format="ct-fp8-channel", arch="llama", seed=1, config={"num_hidden_layers": 2})
    generate(recipe, directory)
    code = main(["compare", str(directory), "--engines", "reference,vllm,vllm[enforce_eager=false]"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "vllm[enforce_eager=false] loaded, perplexity" in out and "no findings" in out


DTYPE_DOUBLES = "tests.doubles.buggy_engines:"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_engine_loaded_in_another_dtype_is_judged_in_it(tmp_path, capsys, monkeypatch, dtype):
    """A `dtype` option is judged in that dtype: weights against the truth cast once to it, logits
    against the reference's own forward in it, with its tolerances. A (deliberately buggy) engine
    that ignores the option and computes in the checkpoint's bfloat16 is caught: its weights beyond
    two ulps of the dtype asked for, and in float32 its logits beyond float32's bound too; one that
    honours it is clean, which in float32 it could not be against the bfloat16 reference's logits."""
    from harness.engines import options

    honoured, ignored = (
        f"{DTYPE_DOUBLES}{name}[dtype={dtype}]" for name in ("DtypeHonouredEngine", "DtypeIgnoredEngine")
    )
    for name in (honoured, ignored):  # the doubles take the option as vLLM and transformers do
        monkeypatch.setitem(options.OPTIONS, name.partition("[")[0], {"dtype": options.MODEL_DTYPE_CHOICES})
    directory = tmp_path / "c"
    recipe = Recipe(format="ct-int4", arch="llama", seed=2, config={"num_hidden_layers": 2})
    generate(recipe, directory)
    main(["compare", str(directory), "--engines", f"reference,{honoured},{ignored}", "--report", str(tmp_path / "r")])
    capsys.readouterr()
    found = json.loads((tmp_path / "r" / "report.json").read_text())["findings"]
    assert not [f for f in found if f["engine"] == honoured], found
    kinds = {f["kind"] for f in found if f["engine"] == ignored}
    assert "weight-mismatch" in kinds, found
    if dtype == "float32":  # bfloat16's forward is 0.03 from float32's here; from float16's, within 0.1
        assert "logprobs" in kinds, found
    assert {f["dtype"] for f in found} == {dtype}


ONLINE_MUTANTS = "tests.doubles.vllm_mutants"


@needs_vllm
@pytest.mark.slow
def test_online_quantization_is_judged_against_the_reference_model_of_its_scheme(tmp_path, monkeypatch):
    """An unquantized bfloat16 Qwen2 (q/k/v biases) loaded with vLLM's online FP8 per channel: the
    weights it quantized are decoded and held to the scheme's own quantization of the truth, its
    logits to the reference's forward with those weights and dynamic per-token FP8 activations; plain
    and online vLLM are clean. Two deliberately buggy doubles are caught: seed 000's pre-fix
    materialize_layer (k_proj's bias non-finite, the logits too) and every scale halved (every
    quantized Linear's weights, by half)."""
    from harness.differential.runner import EngineSession, evaluate
    from harness.engines import options
    from harness.engines.environments import variable_for

    online = "[quantization=fp8_per_channel]"
    engines = ["reference", "vllm", f"vllm{online}"]
    doubles = ("PreFixMaterializeVllm", "OnlineScaleHalvedVllm", "OnlineKernelLastPartHalvedVllm")
    engines += [f"{ONLINE_MUTANTS}:{double}{online}" for double in doubles]
    for engine in engines[3:]:  # the doubles are vLLM: they take its options, in its interpreter
        monkeypatch.setitem(options.OPTIONS, engine.partition("[")[0], options.OPTIONS["vllm"])
        monkeypatch.setenv(variable_for(engine.partition("[")[0]), VLLM_PYTHON)
    directory = tmp_path / "c"
    generate(Recipe(format="unquantized", arch="qwen2", config={"num_hidden_layers": 1}), directory)
    session = EngineSession(engines, tmp_path / "engines")
    try:
        result = evaluate(directory, session)
    finally:
        session.close()
    kinds = {}
    for finding in result.findings:
        kinds.setdefault(finding.engine.rpartition(":")[2], []).append((finding.kind, finding.module))
    assert result.outcomes[f"vllm{online}"].status == "loaded", result.outcomes[f"vllm{online}"].detail
    assert not {"reference", "vllm", f"vllm{online}"} & set(kinds), kinds
    materialized = kinds[f"PreFixMaterializeVllm{online}"]
    biases = {module.rsplit(".", 2)[-2] for kind, module in materialized if kind == "weight-nonfinite"}
    # the first q/k/v shard vLLM loads (k_proj, in the checkpoint's order) is loaded before its layer's
    # loaders are wrapped, so it is not replayed (harness/fixes/materialize_meta_only.py)
    assert biases == {"k_proj"} and ("nonfinite-logits", None) in materialized, materialized
    halved = {module for kind, module in kinds[f"OnlineScaleHalvedVllm{online}"] if kind == "weight-mismatch"}
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {m.rsplit(".", 2)[-2] for m in halved} == linears, halved
    # the kernel's own processing: the weights quantized right, the applied ones not (the basis of the
    # reference loaded with the scheme)
    kernel = f"{ONLINE_MUTANTS}:OnlineKernelLastPartHalvedVllm{online}"
    assert not [k for k, _ in kinds[f"OnlineKernelLastPartHalvedVllm{online}"] if k.startswith("weight")], kinds
    (post,) = [f for f in result.findings if f.engine == kernel and f.kind == "post-load"]
    assert sorted(m.rsplit(".", 1)[-1] for m in post.metrics["modules"]) == ["up_proj", "v_proj"]
    assert post.metrics["worst"]["ratio"] == pytest.approx(0.5, rel=1e-2)
    applied = result.outcomes[f"vllm{online}"].effective_weights  # the LM head is the sampler's, not run
    assert applied.startswith("7/7 Linear(s) apply the weights placed"), applied


def test_online_schemes_are_the_references():
    from harness.engines.options import ONLINE_SCHEMES
    from harness.oracle.online import SCHEMES

    assert ONLINE_SCHEMES == SCHEMES


def test_online_quantization_of_a_quantized_checkpoint_is_unsupported_in_one_line():
    from harness.engines.base import EngineUnsupported
    from harness.engines.vllm.engine import refuse_online_quantization

    with pytest.raises(EngineUnsupported, match="this one is already quantized .compressed-tensors."):
        refuse_online_quantization({"quantization_config": {"quant_method": "compressed-tensors"}}, "fp8_per_channel")
    with pytest.raises(EngineUnsupported, match="mixture-of-experts"):
        refuse_online_quantization({"num_local_experts": 4}, "fp8_per_block")
    refuse_online_quantization({"model_type": "llama"}, "fp8_per_channel")
