"""`python -m harness upstream`: every known issue gets one standalone reproduce.py that imports
only torch, safetensors, the standard library and its engine's package (never this project), whose
checkpoint means what the harness's reference says it means, and which exits 1 while the bug is
present when run as upstream will: another interpreter's `python -I`, from an empty directory."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from harness.checkpoints.architectures import ARCHITECTURES
from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe
from harness.commands.cli import main
from harness.core.errors import HarnessError
from harness.core.naming import canonical_name
from harness.differential.known_issues import KnownIssue, KnownIssues
from harness.differential.relations import RELATION_NAMES
from harness.engines import ENGINES
from harness.engines.environments import engine_python
from harness.formats.base import FormatError
from harness.lanes.upstream import from_issue, render_script
from harness.lanes.upstream.script import unscriptable
from harness.lanes.upstream.source import SCRIPTED_ENGINES
from harness.oracle.reference import format_and_knobs, group_modules
from tests.cli import run_cli

#: the known issues a standalone script can express (dense llama/qwen2, the script formats, the
#: relations it checks); the others' `upstream` is a one-line refusal
#: (test_unexpressible_reproducers_are_refused_in_one_line)
#: the issues of engines a standalone script can drive (sglang's are reproduced by `compare` only)
SCRIPTABLE = [issue for issue in KnownIssues.load().issues if issue.engine in SCRIPTED_ENGINES]
ISSUES = [issue for issue in SCRIPTABLE if unscriptable(from_issue(issue)) is None]
UNEXPRESSIBLE = [issue for issue in SCRIPTABLE if unscriptable(from_issue(issue))]
IDS = [issue.id for issue in ISSUES]
#: the scripts CI runs (one per engine and template family); all of them run in the nightly lane.
#: Every issue's reproducer is also replayed through the harness in CI (tests/differential/test_known_issues.py).
CI_SCRIPTS = {
    "transformers-fp8-block-grid-inferred-from-shape",
    "ct-nvfp4-global-scale-convention-unchecked",
    "vllm-qwen2-ignores-head-dim",
    "transformers-ct-fp8-float32-scales-rounded-to-model-dtype",  # a relation: a second load path
    "ct-kv-scale-never-arrives",  # compressed-tensors on transformers' whole model (its KV cache)
    "transformers-ct-token-activation-scale-spans-every-token-of-a-2d-input",  # activations judged
    "vllm-tp-nvfp4-row-parallel-split-inside-groups",  # vLLM's loaders under a mocked tensor-parallel rank
    "transformers-gptqmodel-cpu-int4-float16-model-computed-in-bfloat16",  # GPTQ read through its kernel
}
RUN_SCRIPTS = [
    pytest.param(issue, id=issue.id, marks=() if issue.id in CI_SCRIPTS else pytest.mark.nightly) for issue in ISSUES
]


@cache
def script_text(issue_id: str) -> str:
    return render_script(from_issue(KnownIssues.load().by_id(issue_id))).text


def script_namespace(issue_id: str) -> dict:
    """The script's definitions, without running it (its `main` runs only as __main__)."""
    namespace = {"__name__": "reproduce"}
    exec(compile(script_text(issue_id), "reproduce.py", "exec"), namespace)
    return namespace


def imported_modules(text: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import in a standalone script"
            found.add(node.module.partition(".")[0])
    return found


def requirements_of(distribution: str) -> set[str]:
    """What installing the engine installs with it (its hard requirements, as importable names):
    a script may use them (compressed-tensors requires transformers and hooks its KV cache into it)."""
    try:
        required = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {
        re.split(r"[\s<>=!~;\[(]", line, maxsplit=1)[0].replace("-", "_") for line in required if "extra ==" not in line
    }


def parameters(text: str) -> dict:
    """The script's literal parameters (CONFIG, KNOBS, ...)."""
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(text).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
        if isinstance(node.value, (ast.Dict, ast.Constant, ast.List))
    }


# ---------------------------------------------------------------- the script, read


@pytest.mark.parametrize("issue", ISSUES, ids=IDS)
def test_script_imports_only_torch_safetensors_and_its_engine(issue):
    modules = imported_modules(script_text(issue.id))
    package = ENGINES[issue.engine].package
    allowed = set(sys.stdlib_module_names) | {"torch", "safetensors", package} | requirements_of(package)
    assert "harness" not in modules
    assert modules <= allowed, f"imports beyond torch, safetensors and {issue.engine}: {modules - allowed}"


@pytest.mark.parametrize("issue", ISSUES, ids=IDS)
def test_script_keeps_the_reproducer_recipe(issue):
    values = parameters(script_text(issue.id))
    recipe = issue.reproducer
    assert values["ISSUE"] == issue.id and values["ENGINE"] == issue.engine and values["FORMAT"] == recipe["format"]
    assert values["CONFIG"]["model_type"] == ARCHITECTURES[recipe["arch"]].model_type
    assert recipe.get("config", {}).items() <= values["CONFIG"].items()
    knobs = dict(recipe.get("knobs", {}))
    if "block_size" in knobs:
        size = knobs.pop("block_size")
        knobs |= {"block_rows": size, "block_cols": size}
    assert knobs.items() <= values["KNOBS"].items()
    assert recipe.get("layout", {}).items() <= values["LAYOUT"].items()
    assert recipe.get("perturb", {}).items() <= values["PERTURB"].items()


@pytest.mark.parametrize("issue", ISSUES, ids=IDS)
def test_script_checkpoint_is_what_the_reference_reads(issue, tmp_path):
    """The script's own quantizer and definition against the harness's reference dequantizer, on
    the checkpoint the script writes: the same values, exactly (modules the reference refuses, a
    NaN scale or a swapped convention, are what the script expects a loader to refuse)."""
    assert_reference_agrees(script_namespace(issue.id), tmp_path)


#: recipes beyond the known issues' reproducers: the other formats, storage and layout knobs
OTHER_RECIPES = {
    "modelopt-nvfp4": {"format": "modelopt-nvfp4", "arch": "llama", "config": {"num_hidden_layers": 1}},
    "ct-nvfp4-w4a4-swapped": {
        "format": "ct-nvfp4",
        "arch": "qwen2",
        "config": {"num_hidden_layers": 1},
        "knobs": {"global_scale_convention": "swapped"},
    },
    "fp8-block-transposed-zero-subnormal": {
        "format": "fp8-block",
        "arch": "llama",
        "config": {"num_hidden_layers": 1, "hidden_size": 200},
        "knobs": {"block_size": 64, "scale_layout": "transposed"},
        "perturb": {"zero_block": True, "subnormal_block": True},
    },
    "ct-fp8-block-shards-split": {
        "format": "ct-fp8-block",
        "arch": "llama",
        "config": {"num_hidden_layers": 1},
        "layout": {"shards": 3, "split_scale": True, "dtype": "float32"},
    },
    "ct-fp8-tensor-input-scale-vlm-prefix": {
        "format": "ct-fp8-tensor",
        "arch": "llama",
        "config": {"num_hidden_layers": 1},
        "knobs": {"input_scale": True},
        "layout": {"key_prefix": "model.language_model."},
        "perturb": {"extreme_amax": "huge"},
    },
    "gptq-asym-v1-act-order": {
        "format": "gptq",
        "arch": "qwen2",
        "config": {"num_hidden_layers": 1},
        "knobs": {"sym": False, "desc_act": True, "group_size": 32},
    },
    "gptq-int8-v2-per-channel-float32-scales": {
        "format": "gptq",
        "arch": "llama",
        "config": {"num_hidden_layers": 1, "intermediate_size": 100},
        "knobs": {"bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2", "scale_storage": "float32"},
        "perturb": {"zero_block": True},
    },
    "awq-partial-group-bfloat16-scales": {
        "format": "awq",
        "arch": "llama",
        "config": {"num_hidden_layers": 1},
        "knobs": {"group_size": 64, "scale_storage": "bfloat16"},
        "perturb": {"subnormal_block": True},
    },
}


@pytest.mark.parametrize("recipe", OTHER_RECIPES.values(), ids=OTHER_RECIPES)
def test_script_checkpoint_is_what_the_reference_reads_for_other_recipes(recipe, tmp_path):
    reproducer = from_issue(ISSUES[0])
    reproducer.recipe = Recipe.from_json({"seed": 0, **recipe})
    namespace = {"__name__": "reproduce"}
    exec(compile(render_script(reproducer).text, "reproduce.py", "exec"), namespace)
    assert_reference_agrees(namespace, tmp_path)


def assert_reference_agrees(namespace: dict, tmp_path: Path) -> None:
    expected = namespace["build_checkpoint"](tmp_path)
    checkpoint = Checkpoint(tmp_path)
    fmt, knobs = format_and_knobs(checkpoint)
    modules, _ = group_modules(checkpoint.names(), fmt)
    # the module a config/tensor disagreement is on: absent from the reference's modules where its
    # scale is (missing-scale, scale-renamed) or where it is stored plain; compared where it is quantized
    target = {(namespace["DISAGREEMENT"] or {}).get("module")}
    assert {canonical_name(m) for m in modules} - target == set(expected) - target
    expected = {module: weight for module, weight in expected.items() if module in map(canonical_name, modules)}
    swapped = namespace["KNOBS"].get("global_scale_convention") == "swapped"
    compared = 0
    for module, parts in modules.items():
        tensors = {suffix: checkpoint.tensor(name) for suffix, name in parts.items()}
        if swapped:  # the script expects the intended weights: read with the reciprocal put back
            tensors |= {s: 1 / t for s, t in tensors.items() if s.endswith("global_scale")}
        try:
            reference = fmt.dequantize(tensors, knobs)
        except FormatError:
            if namespace["KNOBS"].get("scale_layout") != "transposed":
                continue  # refused: the script expects a loader to refuse it too
            # a transposed grid that does not fit: the script expects the intended weights
            scale = next(s for s in tensors if s.startswith("weight_scale"))
            reference = fmt.dequantize(tensors | {scale: tensors[scale].t().contiguous()}, knobs)
        rtol = 2**-23 if swapped else 0  # 1 / (1 / x) in float32
        torch.testing.assert_close(expected[canonical_name(module)], reference, rtol=rtol, atol=0)
        compared += 1
    # refused by design: the module with a non-finite scale, or without its static input scale, or
    # (a format whose marker is not its scale: GPTQ/AWQ's qweight) without its main scale
    refused = namespace["PERTURB"]["nonfinite_scale"] != "none"
    refused += namespace["PERTURB"]["disagreement"] == "missing-input-scale"
    without_scale = namespace["PERTURB"]["disagreement"] in (
        "missing-scale",
        "scale-renamed",
        "index-lists-absent-tensor",
    )
    refused += without_scale and bool(target & set(map(canonical_name, modules)))
    assert compared == len(modules) - refused


def test_script_judges_a_correct_loader_fixed():
    """The verdict rules, on what a correct loader holds: the definition's values, or a refusal
    where the checkpoint is invalid."""
    exact = script_namespace("transformers-fp8-block-grid-inferred-from-shape")
    weights = {"m": torch.randn(160, 64, dtype=torch.float64)}
    assert exact["weight_problems"](weights, weights, exact["scale_block"]) == []
    assert exact["judge_loaded"]([], [])[0] == 0
    assert exact["judge_refusal"](ValueError("no"), [])[0] == 1
    refuse = script_namespace("transformers-nonfinite-scale-accepted")
    assert refuse["judge_refusal"](ValueError("scale is nan"), [])[0] == 0
    assert refuse["judge_loaded"]([], [])[0] == 1


def test_script_kernel_slack_allows_the_zero_point_fold_and_never_a_quantization_step():
    """A GPTQ Linear read through its kernel (modules.applied_weight): the comparison allows two
    roundings of the group's range and the output's rounding (common.kernel_slack), and flags a
    weight a zero point read one off moves by one quantization step (the range / 15), in the
    bfloat16 model of the script and in a float16 one."""
    script = script_namespace("transformers-gptqmodel-cpu-int4-float16-model-computed-in-bfloat16")
    for dtype in (torch.bfloat16, torch.float16):
        script["MODEL_DTYPE"] = dtype
        script["WEIGHT_TOLERANCE"] = {"rel": 2 * torch.finfo(dtype).eps, "abs": 0.0}
        weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64) / 10
        block = script["scale_block"](tuple(weight.shape))
        span = weight.abs().reshape(64, -1, block[1]).amax(-1) * 2  # a symmetric group's range
        step = (span / 15).repeat_interleave(block[1], dim=1)
        bias = torch.linspace(-1, 1, 64, dtype=torch.float64)
        script["PROBED"].clear()
        script["PROBED"]["m"] = bias
        fold = (
            torch.where(torch.arange(96) % 2 == 0, 1.0, -1.0) * 0.9 * script["ulp"](span.repeat_interleave(block[1], 1))
        )
        assert script["weight_problems"]({"m": weight + fold}, {"m": weight}, script["scale_block"]) == []
        off = weight.clone()
        off[5, 7] += step[5, 7]
        problems = script["weight_problems"]({"m": off}, {"m": weight}, script["scale_block"])
        assert (
            len(problems) == 1 and "1 of 6144 elements differ" in problems[0] and "applied by its kernel" in problems[0]
        )


def test_script_activation_judge_passes_the_definition_and_catches_labelled_doubles(tmp_path):
    """The activations piece on one Linear: computing from the input quantized as the config
    specifies (FineGrainedFP8: dynamic FP8 per token and 128 columns) passes; two deliberately
    buggy test doubles, one that drops the quantization and one that quantizes with one scale for
    the whole input (what compressed-tensors' per-token scale does to a 2-D input), are caught."""
    script = script_namespace("transformers-fp8-block-cpu-activations-unquantized")
    scheme = script["activation_scheme"]()
    assert scheme == {"strategy": "group", "dynamic": True, "group_size": 128}
    per_tensor = {"strategy": "tensor", "dynamic": True, "group_size": None}
    inputs = torch.randn(2, 5, 200, generator=torch.Generator().manual_seed(0))
    inputs[:, :, 150:] *= 30  # groups whose scales differ, tokens whose scales differ
    weight = torch.randn(48, 200, generator=torch.Generator().manual_seed(1)) / 16
    verdicts = {}
    for label, quantize in (
        ("definition", lambda x: script["quantize_input"](x, scheme, None)),
        ("double: not applied", lambda x: x),
        ("double: one scale per input", lambda x: script["quantize_input"](x, per_tensor, None)),
    ):
        model = torch.nn.Module()
        model.layer = torch.nn.Linear(200, 48, bias=False)
        model.layer.weight.data = weight
        model.layer.forward = lambda x, q=quantize: torch.nn.functional.linear(q(x).float(), weight)
        with script["ActivationRecorder"](model, ["layer"]) as recorder:
            model.layer(inputs)
        verdicts[label] = script["activation_problems"](recorder, {"layer": weight}, tmp_path)[0]
    assert verdicts["definition"] == []
    assert "activation quantization not applied" in verdicts["double: not applied"][0]
    assert "activation quantization not as specified" in verdicts["double: one scale per input"][0]


class PackedExpertsDouble(torch.nn.Module):
    """A deliberately simple stand-in for transformers' packed experts (gate_up_proj [E, 2I, H],
    down_proj [E, H, I], forward(hidden_states, top_k_index, top_k_weights)), a test double whose
    expert Linears quantize their inputs with `quantize` (the definition, or a labelled bug)."""

    def __init__(self, gate_up, down, quantize):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.quantize = (
            torch.nn.Parameter(gate_up),
            torch.nn.Parameter(down),
            quantize,
        )

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.gate_up_proj.shape[0]):
            tokens, slots = torch.where(top_k_index == expert)
            x = self.quantize(hidden_states[tokens]).float()
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = self.quantize(torch.nn.functional.silu(gate) * up).float()
            y = torch.nn.functional.linear(h, self.down_proj[expert]) * top_k_weights[tokens, slots, None]
            out.index_add_(0, tokens, y)
        return out


def test_script_activation_judge_reads_routed_experts(tmp_path):
    """The activations piece on transformers-style packed experts: experts whose Linears quantize
    their inputs per token pass; a double that runs them unquantized (the known issue's bug) and one
    with one scale per expert call (per tensor) are caught."""
    script = script_namespace("transformers-ct-moe-experts-activations-unquantized")
    scheme = script["activation_scheme"]()
    assert scheme["strategy"] == "token" and script["PACKED_EXPERTS"]["parts"] == ["gate_proj", "up_proj", "down_proj"]
    generator = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 3, 64, 48, 6
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator) / 8
    down = torch.randn(experts, hidden, inter, generator=generator) / 7
    held = {}
    for e in range(experts):
        base = f"model.layers.0.mlp.experts.{e}"
        held |= {
            f"{base}.gate_proj": gate_up[e, :inter],
            f"{base}.up_proj": gate_up[e, inter:],
            f"{base}.down_proj": down[e],
        }
    x = torch.randn(tokens, hidden, generator=generator) * torch.logspace(0, 2, tokens).unsqueeze(1)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    weights = torch.rand(tokens, 2, generator=generator)
    per_tensor = {"strategy": "tensor", "dynamic": True, "group_size": None}
    verdicts = {}
    for label, quantize in (
        ("definition", lambda rows: script["quantize_input"](rows, scheme, None)),
        ("double: not applied", lambda rows: rows),
        ("double: one scale per call", lambda rows: script["quantize_input"](rows, per_tensor, None)),
    ):
        model, layer = torch.nn.Module(), torch.nn.Module()
        model.model = torch.nn.Module()
        model.model.layers = torch.nn.ModuleList([layer])
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = PackedExpertsDouble(gate_up, down, quantize)
        with script["ActivationRecorder"](model, []) as recorder:
            layer.mlp.experts(x, top_k_index=index, top_k_weights=weights)
        verdicts[label] = script["activation_problems"](recorder, held, tmp_path)[0]
    assert verdicts["definition"] == []
    assert "activation quantization not applied" in verdicts["double: not applied"][0]
    assert "activation quantization not as specified" in verdicts["double: one scale per call"][0]


# ---------------------------------------------------------------- the script, run as upstream runs it


def run_standalone(text: str, engine: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the script with the engine's interpreter (`python -I`, an empty working directory, no
    PYTHONPATH); also return every module it imported (`-X importtime`)."""
    python, why = engine_python(engine)
    if python is None:
        pytest.skip(why)
    script, empty = tmp_path / "reproduce.py", tmp_path / "empty"
    script.write_text(text)
    empty.mkdir()
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [python, "-I", "-X", "importtime", str(script)],
        cwd=empty,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, imported


def engine_version(stdout: str) -> Version | None:
    found = re.search(r"^versions: \S+ (\S+),", stdout, re.MULTILINE)
    return Version(found.group(1).split("+")[0]) if found else None


@pytest.fixture(scope="module")
def standalone_runs(request, tmp_path_factory):
    """Every script test_script_reproduces_without_the_project runs in this session, started at
    once, two at a time (each is mostly one interpreter importing torch on one core); the tests
    then read one result each (a skip included)."""
    issues = {
        item.callspec.params["issue"].id: item.callspec.params["issue"].engine
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and getattr(item, "originalname", "") == "test_script_reproduces_without_the_project"
        and not item.get_closest_marker("skip")
    }
    with ThreadPoolExecutor(2) as pool:
        yield {
            issue: pool.submit(run_standalone, script_text(issue), engine, tmp_path_factory.mktemp(issue))
            for issue, engine in sorted(issues.items())
        }


@pytest.mark.slow
@pytest.mark.parametrize("issue", RUN_SCRIPTS)
def test_script_reproduces_without_the_project(issue, standalone_runs):
    done, imported = standalone_runs[issue.id].result()
    assert imported, "no -X importtime output"
    assert not {m for m in imported if m == "harness" or m.startswith("harness.")}, "the script imported harness"
    output = f"{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    version = engine_version(done.stdout)
    if done.returncode == 2 or (version is not None and version not in issue.versions):
        pytest.skip(f"{issue.engine} {version} here: {issue.id} applies to {issue.versions} (exit {done.returncode})")
    assert done.returncode == 1, f"{issue.id}: exit {done.returncode}, expected 1 (bug present)\n{output}"
    assert "verdict: bug present" in done.stdout, output


@pytest.mark.slow
def test_script_says_fixed_when_the_engine_loads_right(tmp_path):
    """The same transformers script with every dimension a multiple of the block: the engine loads
    it as defined, and the script exits 0."""
    reproducer = from_issue(KnownIssues.load().by_id("transformers-fp8-block-grid-inferred-from-shape"))
    reproducer.recipe.config["intermediate_size"] = 256
    done, _ = run_standalone(render_script(reproducer).text, "transformers", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "verdict: fixed" in done.stdout


@pytest.mark.slow
def test_relation_script_says_fixed_when_the_two_load_paths_agree(tmp_path):
    """The dequantize relation's script with scales stored in the model dtype (the default path holds them exactly):
    both paths hold the same weights, and the script exits 0."""
    reproducer = from_issue(KnownIssues.load().by_id("transformers-ct-fp8-float32-scales-rounded-to-model-dtype"))
    assert reproducer.relation == "dequantize"
    reproducer.recipe.knobs["scale_dtype"] = "model"
    done, _ = run_standalone(render_script(reproducer).text, "transformers", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "verdict: fixed" in done.stdout


#: a known issue's script on a checkpoint its engine handles right: it must exit 0 (issue, recipe
#: changes, why the engine is right there); CI_FIXED_VARIANTS run in CI, the others nightly
FIXED_VARIANTS = {
    "activations-as-specified": (
        "transformers-ct-token-activation-scale-spans-every-token-of-a-2d-input",
        {"arch": "llama"},
        "a dense model: transformers calls every Linear on [1, tokens, hidden], each token its own scale",
    ),
    "kv-scales-self-attn": (
        "ct-kv-scale-never-arrives",
        {"layout": {"kv_scales": "self_attn"}},
        "the naming compressed-tensors registers, both of the pair: the whole-model tree loads them",
    ),
    "kv-scales-vllm-whole-pair": (
        "vllm-ct-kv-v-scale-missing-runs-default",
        {"layout": {"kv_scales": "self_attn"}},
        "both of the pair: vLLM's FP8 KV cache runs with the stored k and v scales, exactly",
    ),
    "orphan-scale": (
        "ct-module-without-scale-loads",
        {"perturb": {"disagreement": "orphan-scale"}},
        "a scale for a module the model lacks is left unused, every weight exact",
    ),
    "mxfp4-bfloat16": (
        "ct-mxfp4-decompresses-to-bfloat16",
        {"layout": {"dtype": "bfloat16"}},
        "compressed-tensors decompresses MXFP4 to bfloat16: exact in a bfloat16 model",
    ),
    "index-omits-scale": (
        "transformers-ct-module-without-scale-loads",
        {"layout": {"shards": 2}, "perturb": {"disagreement": "index-omits-tensor"}},
        "transformers reads every shard's tensors, listed or not",
    ),
    "tp-nvfp4-whole-groups": (
        "vllm-tp-nvfp4-row-parallel-split-inside-groups",
        {"config": {"intermediate_size": 512}},
        "512 input columns: 128 per rank at tp 4, whole 16-column groups; every rank holds its slice",
    ),
    "tp-llama4-head-within-a-block": (
        "vllm-llama4-fp8-block-qk-permutation-moves-rows-across-scale-blocks",
        # an MLP of 512: whole 128-row blocks per rank at tp 4 too (its 256 split gate/up inside a
        # block, where vLLM's loader crashes: vllm-tp-fp8-block-fused-part-inside-a-block)
        {"config": {"head_dim": 128, "intermediate_size_mlp": 512}},
        "Llama-4 heads of 128 rows with 128-row blocks: the rotary permutation keeps each row under its scale",
    ),
    "tp-gpt-oss-even-experts": (
        "vllm-gpt-oss-ep-uneven-experts-misplaced",
        {"config": {"num_local_experts": 4}},
        "4 gpt-oss experts at ep 2 and 4: whole experts on each rank; every tp rank holds its share of each",
    ),
    "tp-gptq-whole-groups": (
        "vllm-tp-int4-rank-inputs-not-whole-groups-scales-dropped",
        {"knobs": {"group_size": 32}, "config": {"intermediate_size": 128}},
        "every row-parallel rank holds whole groups of 32 at tp 1, 2 and 4: each holds its slice "
        "(its float16 scales rounded to bfloat16, within that rounding)",
    ),
    "gptq-asym-act-order-bfloat16": (
        "transformers-gptqmodel-cpu-int4-float16-model-computed-in-bfloat16",
        {"layout": {"dtype": "bfloat16"}, "knobs": {"sym": False, "desc_act": True}},
        "a bfloat16 model: GPTQModel's int4 kernel computes in the model's dtype, its zero points "
        "folded within two roundings; the v1 zeros and act-order's g_idx read right",
    ),
    "tp-ct-int4-asym-whole-words": (
        "vllm-ct-int-asym-zero-points-not-whole-words-misplaced",
        {"config": {"head_dim": 32}},
        "k/v of 64 rows: whole words of 8 zero points on every rank at tp 1, 2 and 4; each holds its slice",
    ),
    "tp-fp8-whole-blocks": (
        "vllm-tp-fp8-block-fused-part-inside-a-block",
        {"config": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}},
        "q/k/v parts of 512 and 256 rows: whole 128-row blocks at tp 1 and 2, kv heads repeated at tp 4",
    ),
}


CI_FIXED_VARIANTS = ("activations-as-specified", "gptq-asym-act-order-bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(name, id=name, marks=() if name in CI_FIXED_VARIANTS else pytest.mark.nightly)
        for name in FIXED_VARIANTS
    ],
)
def test_script_says_fixed_where_the_engine_is_right(variant, tmp_path):
    issue_id, changes, _ = FIXED_VARIANTS[variant]
    reproducer = from_issue(KnownIssues.load().by_id(issue_id))
    recipe = reproducer.recipe
    recipe.arch = changes.get("arch", recipe.arch)
    recipe.config |= changes.get("config", {})
    recipe.layout |= changes.get("layout", {})
    recipe.perturb |= changes.get("perturb", {})
    recipe.knobs |= changes.get("knobs", {})
    done, _ = run_standalone(render_script(reproducer).text, reproducer.engine, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "verdict: fixed" in done.stdout


@pytest.mark.parametrize("issue", [i for i in ISSUES if "relation" in i.kinds], ids=lambda i: i.id)
def test_relation_issues_name_the_relation_their_script_checks(issue):
    values = parameters(script_text(issue.id))
    assert values["RELATION"] in RELATION_NAMES and issue.message.removeprefix("^").startswith(values["RELATION"])


# ---------------------------------------------------------------- the command


@pytest.mark.slow
def test_upstream_writes_the_script_and_the_issue_with_the_measured_result(tmp_path):
    out = tmp_path / "out"
    done = run_cli("upstream", "ct-nonfinite-scale-accepted", "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "reproduce.py").read_text() == script_text("ct-nonfinite-scale-accepted")
    issue = (out / "ISSUE.md").read_text()
    for heading in ("## Versions", "## Mechanism", "## Expected", "## Actual", "## How to reproduce"):
        assert heading in issue
    assert "exit 1: bug present" in issue and "verdict: bug present: an invalid checkpoint is accepted" in issue
    assert re.search(r"compressed-tensors \d", issue) and "torch " in issue


def test_upstream_from_a_report_finding(tmp_path):
    checkpoint = tmp_path / "repro"
    set_ = ["--set", "num_hidden_layers=1", "--set", "dtype=float16", "--set", "scale_dtype=float32"]
    assert main(["gen", "--format", "ct-fp8-tensor", "--arch", "llama", "--out", str(checkpoint), *set_]) == 0
    finding = {
        "engine": "compressed-tensors",
        "engine_version": "0.20.0",
        "kind": "weight-mismatch",
        "format": "ct-fp8-tensor",
        "message": "model.layers.0.self_attn.q_proj.weight: 3 elements differ",
        "checkpoint": str(checkpoint),
        "reproduction": str(checkpoint),
        "known_issue": None,
    }
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"findings": [finding]}))
    out = tmp_path / "out"
    assert main(["upstream", "--report", str(report), "--finding", "1", "--out", str(out), "--no-run"]) == 0
    values = parameters((out / "reproduce.py").read_text())
    assert values["FORMAT"] == "ct-fp8-tensor" and values["ENGINE"] == "compressed-tensors"
    assert values["LAYOUT"]["dtype"] == "float16" and values["KNOBS"]["scale_dtype"] == "float32"
    issue = (out / "ISSUE.md").read_text()
    assert "3 elements differ" in issue and "Not measured here" in issue


@pytest.mark.parametrize(
    "argv",
    [
        ["no-such-issue"],
        [],
        ["ct-nonfinite-scale-accepted", "--report", "r.json", "--finding", "1"],
        ["--report", "missing.json", "--finding", "1"],
        ["--finding", "1"],
    ],
)
def test_upstream_usage_errors_exit_2(argv, tmp_path, capsys):
    assert main(["upstream", *argv, "--out", str(tmp_path / "out")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


#: reproducers the scripts cannot express (an issue's recipe changed): each is refused in one line
UNEXPRESSIBLE_CHANGES = {
    "fused-part scales": ("transformers-fp8-block-grid-inferred-from-shape", {"layout": {"fused_scales": "shared"}}),
    "expert weights in vLLM": ("vllm-ct-moe-expert-without-scale-loads", {"kinds": ["weight-mismatch"]}),
    "a plugin's format": ("transformers-fp8-block-grid-inferred-from-shape", {"format": "plugin-int3"}),
    "activations in bfloat16": (
        "transformers-fp8-block-cpu-activations-unquantized",
        {"layout": {"dtype": "bfloat16"}},
    ),
    "activations in vLLM": ("vllm-qwen2-ignores-head-dim", {"kinds": ["activations"]}),
}


@pytest.mark.parametrize("case", [*UNEXPRESSIBLE, *UNEXPRESSIBLE_CHANGES], ids=lambda case: getattr(case, "id", case))
def test_unexpressible_reproducers_are_refused_in_one_line(case):
    issue_id, changes = (case.id, {}) if isinstance(case, KnownIssue) else UNEXPRESSIBLE_CHANGES[case]
    reproducer = from_issue(KnownIssues.load().by_id(issue_id))
    reproducer.kinds = changes.get("kinds", reproducer.kinds)
    reproducer.recipe.format = changes.get("format", reproducer.recipe.format)
    reproducer.recipe.layout |= changes.get("layout", {})
    with pytest.raises(HarnessError, match="no standalone reproducer for its") as refused:
        render_script(reproducer)
    assert "\n" not in str(refused.value) and f"harness check {issue_id}" in str(refused.value)


#: known issues whose standalone script cannot judge them yet, each reproduced by `harness check`
#: (tests/differential/test_known_issues.py replays it through the harness)
WITHOUT_SCRIPT = {
    # vLLM repacks the weights; its script judges layer sizes and a finite forward, and a stale x2
    # scale passes both (the harness reads vLLM's parameters before the repack)
    "vllm-unlisted-stale-duplicate-loaded",
    # the scripts judge activations in a torch model's Linears; vLLM's int8 GEMM is its own kernel
    "vllm-cpu-int8-w8a8-output-off-without-amx",
    # vLLM's processing after loading, judged with stand-in kernels: its script would judge layer
    # sizes and a finite forward pass where the kernel runs, and a part scaled by 0.87 passes both
    "vllm-nvfp4-fused-parts-global-scale-max-without-requantizing",
    "vllm-fp8-tensor-requantization-flushes-subnormal-scales",
    # Llama-4's q/k rotary permutation: the tensor-parallel script builds dense parallel Linears, and
    # every Llama-4 layout the generator writes has routed experts (refused a script)
    "vllm-llama4-gptq-awq-qk-rows-not-permuted-for-rotary",
    "vllm-llama4-ct-int-asym-qk-zero-points-not-permuted-for-rotary",
    # vLLM's MoE processing after loading with its EMULATION backend stood in (no WNA16 MoE backend
    # on CPU): the vLLM script loads through LLM, which refuses the experts here
    "vllm-gptq-moe-emulation-v1-zero-points-off-by-one",
    # the sentinel relation's face of a scripted entry: the scripts run no sentinel relation on vLLM
    "vllm-plain-module-not-ignored-left-unwritten",
}


def test_every_known_issue_has_a_standalone_script():
    """issue #15: every known issue has a reproducer that runs without this project. A new entry
    whose recipe the scripts cannot write fails here until parts/ learn it (or WITHOUT_SCRIPT
    names it, with why)."""
    missing = {issue.id: unscriptable(from_issue(issue)) for issue in UNEXPRESSIBLE}
    assert set(missing) == WITHOUT_SCRIPT, missing
