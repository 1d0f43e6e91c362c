"""`python -m harness audit`: a clean generated checkpoint of every format audits clean, and each
problem class, made by editing a generated checkpoint, is reported on the right tensor with exit 1;
input with nothing to audit is one line and exit 2."""

from __future__ import annotations

import json
import math
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoints.reader import INDEX_FILE, SINGLE_FILE
from harness.checkpoints.recipe import Recipe, apply_settings, home_architecture
from harness.checkpoints.writer import MANIFEST_FILE, TRUTH_DIR, generate
from harness.commands.cli import main
from harness.formats import FORMAT_NAMES, get_format
from harness.oracle.audit import CHECKS, SCALAR_BLOCK_ISSUE
from tests.cli import run_cli

TINY = ["num_hidden_layers=1", "hidden_size=64", "intermediate_size=96"]
Q = "model.layers.0.self_attn.q_proj"
GATE = "model.layers.0.mlp.gate_proj"  # [96, 64]: a non-square grid at block 32
DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Callable[..., Path]:
    """A tiny generated checkpoint per (format, settings), written once per module."""
    made: dict[tuple, Path] = {}

    def make(fmt: str, *settings: str) -> Path:
        key = (fmt, *settings)
        if key not in made:
            directory = tmp_path_factory.mktemp(fmt) / "ckpt"
            recipe = Recipe(format=fmt, arch=home_architecture(fmt, "qwen2"), seed=1)
            generate(apply_settings(recipe, [*TINY, *settings]), directory)
            made[key] = directory
        return made[key]

    return make


@pytest.fixture
def copy(generated, tmp_path) -> Callable[..., Path]:
    """A private copy of a generated checkpoint, to edit."""

    def make(fmt: str, *settings: str) -> Path:
        return Path(shutil.copytree(generated(fmt, *settings), tmp_path / "edited"))

    return make


def audit(directory: Path, report: Path, capsys, *extra: str) -> tuple[int, list[dict], str]:
    code = main(["audit", str(directory), "--report", str(report), *extra])
    out = capsys.readouterr().out
    return code, json.loads((report / "audit.json").read_text())["findings"], out


def shard_of(directory: Path, name: str) -> Path:
    index = directory / INDEX_FILE
    if not index.is_file():
        return directory / SINGLE_FILE
    return directory / json.loads(index.read_text())["weight_map"][name]


def edit_shard(path: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_tensor(directory: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    edit_shard(shard_of(directory, name), lambda tensors: tensors.update({name: change(tensors[name])}))


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def quantization_config(directory: Path, change: Callable[[dict], None]) -> None:
    edit_json(directory / "config.json", lambda config: change(config["quantization_config"]))


def assert_reported(findings: list[dict], check: str, tensor: str, *words: str) -> dict:
    hits = [f for f in findings if f["check"] == check and f["tensor"] == tensor]
    assert hits, f"no {check} finding on {tensor}: {findings}"
    hits = [f for f in hits if all(w in f["reason"] for w in words)] or hits
    assert all(w in hits[0]["reason"] for w in words), hits[0]
    assert hits[0]["module"] == tensor.rpartition(".")[0] and hits[0]["file"]
    return hits[0]


def with_value(index: tuple, value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(tensor: torch.Tensor) -> torch.Tensor:
        edited = tensor.to(torch.float32)
        edited[index] = value
        return edited.to(tensor.dtype)

    return change


# -- no false alarm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [name for name in FORMAT_NAMES if get_format(name).has_scales])
def test_a_clean_checkpoint_of_every_format_audits_clean(fmt, generated, tmp_path, capsys):
    code, findings, out = audit(generated(fmt), tmp_path / "r", capsys)
    assert (code, findings) == (0, []), out
    assert "no problems found" in out and (tmp_path / "r" / "audit.md").is_file()


def test_an_unquantized_checkpoint_is_not_audited(generated, tmp_path, capsys):
    """The audit reads quantization (scales, grids, configs): a checkpoint without a
    quantization_config is one line and exit 2, not a clean audit it never made."""
    code = main(["audit", str(generated("unquantized")), "--report", str(tmp_path / "r")])
    captured = capsys.readouterr()
    assert code == 2 and "not a quantized checkpoint this audit reads" in captured.err + captured.out


@pytest.mark.parametrize(
    "settings",
    [
        ("shards=1",),
        ("shards=3", "split_scale=true"),
        ("key_prefix=model.language_model.", "tie_word_embeddings=true"),
        ("zero_block=true", "block_size=32"),
        ("dtype=float16",),
    ],
    ids=["single-file", "split-scales", "vlm-prefix-tied", "zero-block", "float16"],
)
def test_clean_layouts_audit_clean(settings, generated, tmp_path, capsys):
    code, findings, out = audit(generated("fp8-block", *settings), tmp_path / "r", capsys)
    assert (code, findings) == (0, []), out


@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "modelopt-fp8"])
def test_a_mixtral_in_its_own_expert_naming_audits_clean(fmt, tmp_path, capsys):
    """Mixtral's experts as Mixtral names them (w1/w3/w2; ModelOpt's export also stores each
    expert's input_scale): no `names` finding. Sessions before 43 called every such checkpoint
    'an expert named w1/w3/w2, not mixtral's own w1/w3/w2'; llm-compressor's projection names
    are the finding (test below)."""
    directory = tmp_path / "ckpt"
    generate(apply_settings(Recipe(format=fmt, arch="mixtral", seed=1), [*TINY]), directory)
    code, findings, out = audit(directory, tmp_path / "r", capsys)
    assert (code, findings) == (0, []), out


def test_a_mixtral_with_projection_named_experts_is_told(tmp_path, capsys):
    directory = tmp_path / "ckpt"
    generate(
        apply_settings(Recipe(format="ct-fp8-channel", arch="mixtral", seed=1), [*TINY, "expert_naming=projections"]),
        directory,
    )
    _, findings, _ = audit(directory, tmp_path / "r", capsys)
    expert = "model.layers.0.block_sparse_moe.experts.0.gate_proj"
    assert {f["check"] for f in findings} == {"names"}
    assert_reported(findings, "names", f"{expert}.weight", "not mixtral's own w1/w3/w2")


def test_an_fp8_block_checkpoint_need_not_ignore_its_output_head(copy, tmp_path, capsys):
    """transformers' FineGrainedFP8 never converts lm_head; without config targets it is not a problem."""
    directory = copy("fp8-block")
    quantization_config(directory, lambda q: q.update(modules_to_not_convert=None))
    assert audit(directory, tmp_path / "r", capsys)[:2] == (0, [])


# -- scales ---------------------------------------------------------------------------------------------


def test_a_transposed_block_grid_does_not_fit(copy, tmp_path, capsys):
    directory = copy("fp8-block", "block_size=32")
    edit_tensor(directory, f"{GATE}.weight_scale_inv", lambda t: t.t().contiguous())
    code, findings, out = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "layout", f"{GATE}.weight_scale_inv", "[2, 3]", "needs the grid [3, 2]")
    assert "layout" in out and "weight_scale_inv" in out


def test_an_nvfp4_group_scale_grid_one_column_short(copy, tmp_path, capsys):
    directory = copy("ct-nvfp4")
    edit_tensor(directory, f"{DOWN}.weight_scale", lambda t: t[:, :-1].contiguous())
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "layout", f"{DOWN}.weight_scale", "expected [64, 6]")


@pytest.mark.parametrize(
    ("value", "what"),
    [(math.nan, "1 non-finite value(s)"), (math.inf, "1 non-finite"), (0.0, "1 zero"), (1e-40, "1 subnormal")],
    ids=["nan", "inf", "zero", "subnormal"],
)
def test_bad_scale_values_are_counted_with_the_first_location(value, what, copy, tmp_path, capsys):
    directory = copy("fp8-block", "block_size=32")
    edit_tensor(directory, f"{GATE}.weight_scale_inv", with_value((2, 1), value))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "scale-values", f"{GATE}.weight_scale_inv", what, "first at [2, 1]")
    assert len(findings) == 1, findings  # the oracle's refusal of the same NaN is not a second finding


def test_a_nan_e4m3_group_scale_and_a_subnormal_one(copy, tmp_path, capsys):
    directory = copy("modelopt-nvfp4")

    def change(scale: torch.Tensor) -> torch.Tensor:
        raw = scale.view(torch.uint8).clone()
        raw[3, 2], raw[4, 0], raw[5, 0] = 0x7F, 0x01, 0x02  # NaN, then two subnormals (2**-9, 2**-8)
        return raw.view(torch.float8_e4m3fn)

    edit_tensor(directory, f"{Q}.weight_scale", change)
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "scale-values", f"{Q}.weight_scale", "1 non-finite", "first at [3, 2]")
    assert_reported(findings, "scale-values", f"{Q}.weight_scale", "2 subnormal", "first at [4, 0]: 0.00195312")


@pytest.mark.parametrize(
    ("fmt", "suffix", "words"),
    [
        ("ct-nvfp4", "weight_global_scale", ("< 1", "ModelOpt multiplier")),
        ("ct-nvfp4a16", "weight_global_scale", ("< 1", "ModelOpt multiplier")),
        ("modelopt-nvfp4", "weight_scale_2", ("> 1", "compressed-tensors divisor")),
    ],
)
def test_an_nvfp4_global_scale_in_the_other_convention(fmt, suffix, words, copy, tmp_path, capsys):
    directory = copy(fmt)
    edit_tensor(directory, f"{DOWN}.{suffix}", lambda t: 1.0 / t)
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "global-scale", f"{DOWN}.{suffix}", *words)


# -- tensors that belong together ----------------------------------------------------------------------


def test_a_quantized_weight_without_its_scale(copy, tmp_path, capsys):
    directory = copy("ct-fp8-channel")
    name = f"{Q}.weight_scale"
    edit_shard(shard_of(directory, name), lambda tensors: tensors.pop(name))
    edit_json(directory / INDEX_FILE, lambda index: index["weight_map"].pop(name))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "missing-scale", name, "no weight_scale")
    assert len(findings) == 1, findings


def test_orphan_scales(copy, tmp_path, capsys):
    """A scale whose weight was dropped, and one for a module that never existed."""
    directory = copy("fp8-block")
    weight, stray = f"{DOWN}.weight", "model.layers.0.mlp.extra_proj.weight_scale_inv"
    edit_shard(shard_of(directory, weight), lambda tensors: tensors.pop(weight))
    edit_shard(shard_of(directory, Q + ".weight"), lambda tensors: tensors.update({stray: torch.ones(1, 1)}))

    def index(data: dict) -> None:
        data["weight_map"].pop(weight)
        data["weight_map"][stray] = data["weight_map"][Q + ".weight"]

    edit_json(directory / INDEX_FILE, index)
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "orphan-scale", f"{DOWN}.weight_scale_inv", "no weight")
    assert_reported(findings, "orphan-scale", stray, "no weight")


def test_a_declared_input_scale_is_required_and_an_undeclared_one_is_an_orphan(copy, tmp_path, capsys):
    directory = copy("ct-fp8-tensor", "input_scale=true")
    name = f"{Q}.input_scale"
    edit_shard(shard_of(directory, name), lambda tensors: tensors.pop(name))
    edit_json(directory / INDEX_FILE, lambda index: index["weight_map"].pop(name))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "missing-scale", name)
    group = "group_0"
    quantization_config(directory, lambda q: q["config_groups"][group]["input_activations"].update(dynamic=True))
    code, findings, _ = audit(directory, tmp_path / "r2", capsys)
    assert code == 1
    assert_reported(findings, "orphan-scale", f"{DOWN}.input_scale", "does not declare")


# -- the ignore list ------------------------------------------------------------------------------------


def test_a_module_stored_quantized_but_ignored(copy, tmp_path, capsys):
    directory = copy("ct-nvfp4")
    quantization_config(directory, lambda q: q["ignore"].append("re:.*mlp.down_proj$"))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "ignore-list", f"{DOWN}.weight_packed", "ignore list names it")
    assert len(findings) == 1, findings


@pytest.mark.parametrize("fmt", ["ct-fp8-block", "modelopt-nvfp4"])
def test_an_unquantized_linear_that_is_not_excluded(fmt, copy, tmp_path, capsys):
    directory = copy(fmt)
    quantization_config(directory, lambda q: q.update(ignore=[]))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "ignore-list", "lm_head.weight", "BF16", "neither ignored")


def test_a_dequantized_module_in_an_fp8_checkpoint_that_is_not_excluded(copy, tmp_path, capsys):
    directory = copy("fp8-block", "shards=1")

    def dequantize(tensors: dict) -> None:
        tensors[f"{Q}.weight"] = tensors[f"{Q}.weight"].to(torch.bfloat16)
        tensors.pop(f"{Q}.weight_scale_inv")

    edit_shard(directory / SINGLE_FILE, dequantize)
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "ignore-list", f"{Q}.weight", "stored as BF16")
    quantization_config(directory, lambda q: q["modules_to_not_convert"].append("self_attn.q_proj"))
    assert audit(directory, tmp_path / "r2", capsys)[:2] == (0, [])


# -- index vs shards ------------------------------------------------------------------------------------


def test_a_tensor_listed_but_absent_and_one_present_but_not_listed(copy, tmp_path, capsys):
    directory = copy("ct-fp8-block")
    unlisted = f"{DOWN}.weight_scale"

    def index(data: dict) -> None:
        data["weight_map"]["model.layers.0.mlp.phantom.weight"] = data["weight_map"][f"{Q}.weight"]
        data["weight_map"].pop(unlisted)

    edit_json(directory / INDEX_FILE, index)
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "index", "model.layers.0.mlp.phantom.weight", "listed in the index but absent")
    assert_reported(findings, "index", unlisted, "not listed in the index")


def test_a_tensor_stored_in_two_shards(copy, tmp_path, capsys):
    directory = copy("fp8-block")
    name = f"{Q}.weight_scale_inv"
    copied = load_file(str(shard_of(directory, name)))[name]
    other = next(p for p in directory.glob("model-*.safetensors") if p != shard_of(directory, name))
    edit_shard(other, lambda tensors: tensors.update({name: copied}))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "index", name, "stored in 2 shards")


def test_a_shard_the_index_never_names(copy, tmp_path, capsys):
    directory = copy("ct-fp8-tensor")
    shutil.copy(shard_of(directory, f"{Q}.weight"), directory / "leftover.safetensors")
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert [(f["check"], f["file"]) for f in findings] == [("index", "leftover.safetensors")]
    assert "the index never names" in findings[0]["reason"]


def test_an_index_path_escaping_the_directory_and_a_missing_shard(copy, tmp_path, capsys):
    directory = copy("ct-nvfp4a16")
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    first, second = sorted(set(weight_map.values()))
    escaping = next(n for n, s in sorted(weight_map.items()) if s == first)
    (directory / second).unlink()
    edit_json(directory / INDEX_FILE, lambda index: index["weight_map"].update({escaping: f"../{first}"}))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "index", escaping, "escapes the checkpoint directory")
    lost = min(n for n, s in weight_map.items() if s == second)
    missing = assert_reported(findings, "index", lost, "not found")
    assert missing["file"] == second


# -- config fields ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("block", "word"), [(128, "scalar"), ([128], "one-element")])
def test_a_scalar_or_one_element_weight_block_size(block, word, copy, tmp_path, capsys):
    directory = copy("fp8-block")
    quantization_config(directory, lambda q: q.update(weight_block_size=block))
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert [(f["check"], f["file"]) for f in findings] == [("config", "config.json")]
    assert word in findings[0]["reason"] and SCALAR_BLOCK_ISSUE in findings[0]["reason"]


def test_the_scalar_block_size_issue_cited_is_a_known_issue():
    known = tomllib.loads((Path(__file__).parents[1] / "cases" / "known_issues.toml").read_text())
    assert SCALAR_BLOCK_ISSUE in {issue["id"] for issue in known["issue"]}


@pytest.mark.parametrize("status", ["frozen", None])
def test_a_quantization_status_other_than_compressed(status, copy, tmp_path, capsys):
    directory = copy("ct-fp8-channel")
    quantization_config(
        directory, lambda q: q.update(quantization_status=status) if status else q.pop("quantization_status")
    )
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert [f["check"] for f in findings] == ["config"] and "quantization_status" in findings[0]["reason"]


# -- weights ----------------------------------------------------------------------------------------------


def test_non_finite_weights_plain_and_fp8(copy, tmp_path, capsys):
    directory = copy("fp8-block")
    norm = "model.layers.0.input_layernorm.weight"
    edit_tensor(directory, norm, with_value((5,), math.inf))

    def nan_code(weight: torch.Tensor) -> torch.Tensor:
        raw = weight.view(torch.uint8).clone()
        raw[1, 3] = 0x7F
        return raw.view(torch.float8_e4m3fn)

    edit_tensor(directory, f"{Q}.weight", nan_code)
    code, findings, _ = audit(directory, tmp_path / "r", capsys)
    assert code == 1
    assert_reported(findings, "weight-values", norm, "1 non-finite", "first at [5]: inf")
    assert_reported(findings, "weight-values", f"{Q}.weight", "first at [1, 3]: nan")


# -- unusable input and the command line -------------------------------------------------------------------


def unusable_inputs(root: Path, clean: Path) -> dict[str, Path]:
    cases = {"missing": root / "nowhere", "a file": root / "file"}
    cases["a file"].write_text("x")
    for name, change in {
        "no config": lambda d: (d / "config.json").unlink(),
        "config not JSON": lambda d: (d / "config.json").write_text("{"),
        "not quantized": lambda d: edit_json(d / "config.json", lambda c: c.pop("quantization_config")),
        "unknown format": lambda d: quantization_config(d, lambda q: q.update(quant_method="gguf")),
        "index without weight_map": lambda d: (d / INDEX_FILE).write_text("{}"),
        "no tensors at all": lambda d: [p.unlink() for p in d.glob("model*")],
    }.items():
        cases[name] = Path(shutil.copytree(clean, root / name.replace(" ", "-")))
        change(cases[name])
    return cases


def test_input_with_nothing_to_audit_is_one_line_and_exit_2(generated, tmp_path, capsys):
    for what, directory in unusable_inputs(tmp_path, generated("fp8-block")).items():
        assert main(["audit", str(directory)]) == 2, what
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, (what, captured.err)
        lead = "unsupported: " if what == "unknown format" else "error: "  # a valid scheme it does not know
        assert captured.err.startswith(lead) and str(directory) in captured.err, (what, captured.err)


def test_the_command_line_registers_audit(tmp_path):
    done = run_cli("audit", tmp_path / "nowhere")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "not found" in done.stderr and "audit" in run_cli("--help").stdout


def test_every_check_is_documented():
    text = (Path(__file__).parents[1] / "docs" / "audit.md").read_text()
    assert all(f"`{check}`" in text for check in CHECKS)


# -- the differential judgement after the audit -----------------------------------------------------------


@pytest.mark.slow
def test_engines_reference_on_a_foreign_nan_scale_checkpoint_infers_refuse(tmp_path, capsys):
    pytest.importorskip("transformers")
    directory = tmp_path / "nan"
    generate(
        apply_settings(Recipe(format="fp8-block", arch="qwen2", seed=1), [*TINY, "nonfinite_scale=nan"]), directory
    )
    (directory / MANIFEST_FILE).unlink()  # a checkpoint the harness did not write
    shutil.rmtree(directory / TRUTH_DIR)
    code, findings, out = audit(directory, tmp_path / "r", capsys, "--engines", "reference")
    assert code == 1, out
    nan_scale = next(f for f in findings if f["check"] == "scale-values")
    assert "non-finite" in nan_scale["reason"]
    differential = json.loads((tmp_path / "r" / "audit.json").read_text())["differential"]
    assert differential["expectation"] == "refuse"
    assert differential["why"].startswith(f"refuse: the reference refuses {nan_scale['tensor']}: ")
    assert differential["checkpoint"]["outcomes"]["reference"]["status"] == "refused"
    assert f"expectation refuse: the reference refuses {nan_scale['tensor']}" in out
    assert "Expectation refuse" in (tmp_path / "r" / "audit.md").read_text()
    assert (tmp_path / "r" / "report.json").is_file()
