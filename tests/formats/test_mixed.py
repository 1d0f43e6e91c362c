"""compressed-tensors mixed precision (harness/formats/mixed.py): each module read in the scheme of
the config group that targets it, chosen as compressed-tensors itself chooses; a module stored in
another group's scheme refused; the audit, the activation plan, the tolerances and known-issue
attribution each per group. On what llm-compressor 0.14 wrote (cases/producers/llmcompressor)."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoints.reader import Checkpoint
from harness.core.errors import CheckpointError
from harness.core.findings import Finding
from harness.core.tolerances import load_tolerances, loosest_tolerances
from harness.differential.known_issues import readings
from harness.differential.preconditions import SCHEMES, checkpoint_context
from harness.formats import detect_format
from harness.formats.mixed_groups import Member, layer_assignments, targeting_group
from harness.oracle.audit import audit_checkpoint
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs

CORPUS = Path(__file__).resolve().parents[2] / "cases" / "producers" / "llmcompressor"
FP8_NVFP4 = CORPUS / "llama-fp8-attn-nvfp4-mlp"  # FP8 static attention, NVFP4 W4A4 MLP
FP8_INT4_MOE = CORPUS / "qwen3_moe-fp8-dynamic-attn-w4a16-experts"  # FP8 dynamic attention, int4 experts
OVERLAP = CORPUS / "llama-fp8-dynamic-attn-last-mlp-w4a16-mlp"  # both groups name layer 1's MLP

#: (groups' targets in config order, ignore) -> module names to resolve: exact names, patterns, the
#: class name, a target two groups list, patterns that overlap, an ignored module
TARGET_CASES = [
    ([["re:.*self_attn.*"], ["Linear"]], [], ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"]),
    (
        [["re:.*mlp\\.(gate|up|down)_proj$"], ["re:model\\.layers\\.1\\.mlp\\..*", "re:.*self_attn.*"]],
        [],
        ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj", "model.layers.1.self_attn.o_proj"],
    ),
    (
        [["re:.*mlp.*"], ["model.layers.1.mlp.down_proj"]],
        [],
        ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"],
    ),
    ([["re:.*proj$"], ["re:.*proj$", "Linear"]], ["re:.*o_proj$"], ["model.layers.0.self_attn.o_proj", "x.q_proj"]),
    ([["Linear"], ["re:.*experts.*"]], ["lm_head"], ["model.layers.0.mlp.experts.3.up_proj", "lm_head", "x.gate"]),
]


@pytest.mark.parametrize(("targets", "ignore", "modules"), TARGET_CASES)
def test_a_module_is_its_group_as_compressed_tensors_chooses(targets, ignore, modules):
    """The group compressed-tensors 0.20 itself gives a Linear of that name (`match_targets`, then its
    apply's first target, a later group's for a repeated target), or none where its ignore list names it."""
    from compressed_tensors.utils.match import is_match, match_targets

    members = [Member(f"group_{i}", tuple(t), None, {}, {}) for i, t in enumerate(targets)]
    owner = OrderedDict()
    for member in members:
        for target in member.targets:
            owner[target] = member.group
    linear = torch.nn.Linear(1, 1)
    for module in modules:
        mine = targeting_group({"members": members, "ignore": ignore}, module)
        if not is_match(module, linear, list(owner), ignore):
            assert mine is None, module
            continue
        assert mine is not None and mine.group == owner[match_targets(module, linear, list(owner))[0]], module


def test_nvfp4_beside_fp8_is_mixed_not_nvfp4():
    """ct-nvfp4 once read a config whose other group is FP8 as NVFP4, its FP8 modules as plain tensors."""
    config = json.loads((FP8_NVFP4 / "config.json").read_text())["quantization_config"]
    fmt = detect_format(config)
    assert fmt.name == "mixed-precision"
    knobs = fmt.knobs_from_config(config)
    assert [(m.group, m.fmt.name) for m in knobs["members"]] == [("group_0", "ct-fp8-tensor"), ("group_1", "ct-nvfp4")]
    assert {s.name for s in fmt.schemes(knobs)} == {"ct-fp8-tensor", "ct-nvfp4"}


def test_each_module_is_read_in_its_groups_scheme():
    """The reference's weights against llm-compressor's own fake quantization, module by module."""
    truth = load_file(str(FP8_NVFP4 / "producer_truth" / "weights.safetensors"))
    reference = dict(dequantize_checkpoint(FP8_NVFP4))
    fmt, knobs = format_and_knobs(FP8_NVFP4)
    assert fmt.for_module("model.layers.0.self_attn.q_proj", knobs)[0].name == "ct-fp8-tensor"
    assert fmt.for_module("model.layers.0.mlp.up_proj", knobs)[0].name == "ct-nvfp4"
    for name, want in truth.items():
        assert torch.equal(reference[name].to(want.dtype), want), name


def edited(source: Path, tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    directory = Path(shutil.copytree(source, tmp_path / source.name))
    (directory / "provenance.json").unlink()
    if edit_config:
        config = json.loads((directory / "config.json").read_text())
        edit_config(config["quantization_config"])
        (directory / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(str(directory / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_a_module_stored_in_another_groups_scheme_is_refused(tmp_path):
    """The FP8 group names up_proj exactly (exact names come first), but up_proj holds NVFP4 tensors:
    a loader that follows the config misreads it, so the reference refuses it and audit says so."""

    def name_up_proj(config):
        config["config_groups"]["group_0"]["targets"].append("model.layers.0.mlp.up_proj")

    directory = edited(FP8_NVFP4, tmp_path, edit_config=name_up_proj)
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj"):
        dict(dequantize_checkpoint(directory))
    problems = [(item.check, item.tensor) for item in audit_checkpoint(directory).findings]
    assert problems and all("model.layers.0.mlp.up_proj" in tensor for _, tensor in problems), problems


def test_audit_judges_each_module_by_its_group(tmp_path):
    """An int4 expert without its weight_scale: reported as the int4 group's missing scale."""
    scale = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    directory = edited(FP8_INT4_MOE, tmp_path, edit_tensors=lambda tensors: tensors.pop(scale))
    assert not audit_checkpoint(FP8_INT4_MOE).findings
    problems = [(item.check, item.tensor) for item in audit_checkpoint(directory).findings]
    assert ("missing-scale", scale) in problems, problems


def test_the_activation_plan_is_per_group():
    """FP8 attention's inputs are quantized, the weight-only int4 experts' are not; FP8 static
    attention beside NVFP4 MLP: each Linear in its own group's activation scheme."""
    from harness.oracle.specified import plan

    moe = plan(Checkpoint(FP8_INT4_MOE))
    assert sorted(moe.inputs) == [f"model.layers.0.self_attn.{p}_proj" for p in "koqv"] and not moe.experts
    assert (moe.scheme.kind, moe.scheme.strategy, moe.own) == ("fp8", "token", {})
    dense = plan(Checkpoint(FP8_NVFP4))
    kinds = {name.rpartition(".")[2]: dense.scheme_for(name).kind for name in dense.inputs}
    assert kinds == {"q_proj": "fp8", "k_proj": "fp8", "v_proj": "fp8", "o_proj": "fp8"} | dict.fromkeys(
        ("gate_proj", "up_proj", "down_proj"), "nvfp4"
    )


def test_tolerances_are_the_loosest_of_the_groups():
    fp8, int4 = load_tolerances("ct-fp8-tensor", "bfloat16"), load_tolerances("ct-int4", "bfloat16")
    both = loosest_tolerances(["ct-int4", "ct-fp8-tensor"], "bfloat16")
    assert fp8 != int4
    assert both.logprob_max_abs_delta == max(fp8.logprob_max_abs_delta, int4.logprob_max_abs_delta)
    assert both.perplexity_rel == max(fp8.perplexity_rel, int4.perplexity_rel)
    assert both.weight_rel == fp8.weight_rel == int4.weight_rel


def test_a_finding_is_attributed_in_the_groups_it_concerns():
    """A module's finding is read in its group's format and knobs; a checkpoint-wide one in each."""
    context = checkpoint_context(FP8_INT4_MOE)
    assert [name for name, _ in context[SCHEMES]] == ["ct-fp8-channel", "ct-int4"]
    module = Finding("vllm", "v", "weight-mismatch", "ct-int4", "m", module="model.layers.0.mlp.experts.0.up_proj")
    ((reading, facts),) = readings(module, context)
    assert reading.format == "ct-int4" and facts["group_size"] == 128 and facts["weight_bits"] == 4
    wide = Finding("vllm", "v", "load-error", "mixed-precision", "m")
    assert [(r.format, f.get("weight_strategy")) for r, f in readings(wide, context)] == [
        ("ct-fp8-channel", "channel"),
        ("ct-int4", "group"),
    ]


def test_every_distinct_layer_naming_is_judged():
    """Layer 1's MLP is named by both groups (Unsloth's layout): the stand-in judge looks at it too."""
    fmt, knobs = format_and_knobs(OVERLAP)
    assert sorted(layer_assignments(Checkpoint(OVERLAP).names(), knobs).values()) == [0, 1]
    fmt, knobs = format_and_knobs(FP8_NVFP4)
    assert sorted(layer_assignments(Checkpoint(FP8_NVFP4).names(), knobs).values()) == [0]


def test_modelopt_mixed_precision_reads_as_its_single_format_exports():
    """ModelOpt's MIXED_PRECISION export (FP8 attention, NVFP4 MLP; one group per format, exact
    names, `quantized_layers`): each Linear reads as ModelOpt's FP8 and NVFP4 exports of the same
    seeded model read, element for element."""
    modelopt = CORPUS.parent / "modelopt"
    mixed = modelopt / "fp8_attn_nvfp4_mlp"
    fmt, knobs = format_and_knobs(mixed)
    assert [(m.group, m.fmt.name) for m in knobs["members"]] == [
        ("group_0", "modelopt-fp8"),
        ("group_1", "modelopt-nvfp4"),
    ]
    reading = dict(dequantize_checkpoint(mixed))
    fp8, nvfp4 = dict(dequantize_checkpoint(modelopt / "fp8")), dict(dequantize_checkpoint(modelopt / "nvfp4"))
    assert set(reading) == set(fp8)
    for name, value in reading.items():
        if name.endswith("_proj.weight"):
            single = fp8 if ".self_attn." in name else nvfp4
            assert torch.equal(value, single[name]), name


#: GPTQ `dynamic` overrides (in the config's order) -> module names to resolve: the first matching
#: pattern decides, a `-:` one leaves the Linear unquantized, no match keeps the config's own scheme
DYNAMIC_CASES = [
    (
        {"+:.*\\.mlp\\..*": {"bits": 8, "group_size": 32}},
        ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"],
    ),
    (
        {"-:.*\\.layers\\.1\\..*": {}, "+:.*down_proj": {"bits": 8}, ".*proj": {"group_size": 32}},
        ["model.layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj", "lm_head"],
    ),
    ({".*o_proj": {"sym": False}, "+:.*self_attn.*": {"desc_act": True}}, ["x.self_attn.o_proj", "x.self_attn.q_proj"]),
]


@pytest.mark.parametrize(("dynamic", "modules"), DYNAMIC_CASES)
def test_a_gptq_linear_is_its_override_as_gptqmodel_reads_it(dynamic, modules):
    """The override GPTQModel 7.6's own `dynamic_get` gives a Linear of that name (False: left
    unquantized), against the group gptq-dynamic reads it in."""
    pytest.importorskip("gptqmodel")
    from gptqmodel.quantization.config import dynamic_get

    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False, "dynamic": dynamic}
    fmt = detect_format(config)
    assert fmt.name == "gptq-dynamic"
    knobs = fmt.knobs_from_config(config)
    for module in modules:
        theirs, mine = dynamic_get(dynamic, module), targeting_group(knobs, module)
        if theirs is False:
            assert mine is None, module
            continue
        fields = {k: v for k, v in (theirs or {}).items() if k in ("bits", "group_size", "sym", "desc_act")}
        assert mine is not None and {k: mine.knobs[k] for k in fields} == fields, module
        assert mine.group == ("base" if not fields else next(p for p in dynamic if dynamic[p] == theirs)), module


def test_an_auto_round_linear_is_its_extra_config_as_auto_round_reads_it():
    """AutoRound's mixed bits: the setting AutoRound 0.16's own loader expands `extra_config` into for
    each Linear (`_expand_regex_config`: exact names kept, then patterns searched in order), against the
    group gptq-dynamic reads it in; a 16-bit entry leaves the Linear unquantized."""
    pytest.importorskip("auto_round")
    from auto_round.inference.utils import _expand_regex_config

    extra = {
        "model.layers.0.mlp.up_proj": {"bits": 16},
        ".*mlp.*": {"bits": 8, "group_size": 32},
        "model.layers.1.mlp.down_proj": {"bits": 4, "group_size": 64},
        "self_attn.o": {"bits": 8, "group_size": 32},
    }
    config = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128}
    config |= {"sym": True, "data_type": "int", "block_name_to_quantize": "model.layers", "extra_config": extra}
    names = [
        f"model.layers.{i}.{m}"
        for i in (0, 1)
        for m in ("mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "self_attn.q_proj")
    ]
    model = torch.nn.Module()  # only its Linears' names are read: the layer names patterns expand over
    model.named_modules = lambda: [(name, torch.nn.Linear(1, 1)) for name in names]
    theirs = _expand_regex_config(dict(extra), dict(extra), names, model)
    fmt = detect_format(config)
    assert fmt.name == "gptq-dynamic"
    knobs = fmt.knobs_from_config(config)
    for name in names:
        mine, setting = targeting_group(knobs, name), theirs.get(name, {})
        if setting.get("bits") == 16:
            assert mine is None, name
            continue
        expected = {"bits": 4, "group_size": 128} | {k: v for k, v in setting.items() if k in ("bits", "group_size")}
        assert mine is not None and {k: mine.knobs[k] for k in expected} == expected, (name, setting)
