"""Relations that need no reference (harness.differential.relations): a correct engine holds each
one on a small generated checkpoint; labelled buggy doubles (tests/doubles/buggy_engines.py) that
keep state across loads, leave a parameter unwritten or save lossily are each caught as a
`relation` finding naming the relation and the first differing tensor and position."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.core.findings import Finding
from harness.differential.relations import CAMPAIGN_EVERY, RELATION_NAMES, parse_relations, sampled
from harness.differential.runner import EngineSession, evaluate
from tests.cli import run_cli

DOUBLES = "tests.doubles.buggy_engines"
CACHED = f"{DOUBLES}:CachedConversionEngine"
UNWRITTEN = f"{DOUBLES}:UnwrittenParameterEngine"
LOSSY = f"{DOUBLES}:LossySaveEngine"


def small_checkpoint(directory, dtype="bfloat16", fmt="ct-fp8-channel"):
    recipe = Recipe(format=fmt, arch="llama", config={"num_hidden_layers": 1}, layout={"dtype": dtype})
    generate(recipe, directory)
    return directory


def test_relations_are_parsed_by_name():
    assert parse_relations("all") == RELATION_NAMES
    assert parse_relations("none") == parse_relations("") == parse_relations(None) == ()
    assert parse_relations("round-trip, load-twice,round-trip") == ("round-trip", "load-twice")
    with pytest.raises(HarnessError, match="unknown relation"):
        parse_relations("load-thrice")


def test_the_campaign_samples_each_relation_in_turn_on_a_fixed_fraction():
    picks = [sampled(example) for example in range(1, 4 * CAMPAIGN_EVERY * len(RELATION_NAMES) + 1)]
    chosen = [p for p in picks if p]
    assert len(chosen) == len(picks) // CAMPAIGN_EVERY and all(len(p) == 1 for p in chosen)
    assert [p[0] for p in chosen[: len(RELATION_NAMES)]] == list(RELATION_NAMES)
    assert sampled(CAMPAIGN_EVERY, ()) == () and sampled(CAMPAIGN_EVERY - 1) == ()


def test_the_least_checked_relation_goes_first_on_checkpoints_like_this_one():
    """Counted per format and architecture (the campaign's `checked`): a relation never checked
    there goes before one whose turn it is; ties keep the turn order."""
    turn = CAMPAIGN_EVERY  # the first relation's turn
    first, second = RELATION_NAMES[0], RELATION_NAMES[1]
    assert sampled(turn, checked={}) == sampled(turn) == (first,)
    assert sampled(turn, checked={first: 1}) == (second,)
    everyone = {name: 2 for name in RELATION_NAMES} | {RELATION_NAMES[-1]: 1}
    assert sampled(turn, checked=everyone) == (RELATION_NAMES[-1],)
    modelopt = {"quantization_config": {"quant_method": "modelopt"}}
    unchecked_but_inapplicable = {name: 1 for name in RELATION_NAMES} | {"dequantize": 0}
    assert sampled(turn, config=modelopt, checked=unchecked_but_inapplicable) == (first,)


def test_a_turn_whose_relation_does_not_apply_passes_to_the_next_that_does():
    """dequantize applies to compressed-tensors and FineGrainedFP8 only: on a ModelOpt checkpoint its
    turn goes to the next relation in order; on a compressed-tensors one it keeps it."""
    turn = CAMPAIGN_EVERY * (RELATION_NAMES.index("dequantize") + 1)
    modelopt = {"quantization_config": {"quant_method": "modelopt"}}
    compressed = {"quantization_config": {"quant_method": "compressed-tensors"}}
    following = RELATION_NAMES[(RELATION_NAMES.index("dequantize") + 1) % len(RELATION_NAMES)]
    assert sampled(turn, config=modelopt) == (following,)
    assert sampled(turn, config=compressed) == sampled(turn) == ("dequantize",)


def test_a_relation_finding_is_one_signature_whichever_tensor_shows_it_first():
    def finding(tensor):
        return Finding(
            engine="transformers",
            engine_version="5",
            kind="relation",
            format="fp8-block",
            message=f"round-trip: {tensor} differs at [0, 0]: 0.0087 on the first load, 10 on the second",
            metrics={"relation": "round-trip", "failure": "weights differ", "tensor": tensor},
        )

    one, two = finding("model.layers.0.self_attn.o_proj.weight"), finding("model.layers.3.mlp.down_proj.weight")
    assert one.signature() == two.signature() and one.cause() == "round-trip: weights differ"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    pytest.importorskip("transformers")
    session = EngineSession(["reference", "transformers", CACHED, UNWRITTEN, LOSSY], tmp_path_factory.mktemp("engines"))
    yield session
    session.close()


#: `offload` does not hold for transformers on compressed-tensors checkpoints (an upstream finding,
#: docs/findings.md): it is checked on fp8-block below; `tensor-parallel` is vLLM's
#: (tests/test_tensor_parallel.py)
ON_CT = tuple(name for name in RELATION_NAMES if name not in ("offload", "tensor-parallel"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_correct_engines_hold_every_relation(session, tmp_path, dtype):
    directory = small_checkpoint(tmp_path / "c", dtype)
    result = evaluate(directory, session, engines=["reference", "transformers"], relations=ON_CT)
    assert not result.findings, [f.message for f in result.findings]
    reference, transformers = result.outcomes["reference"].relations, result.outcomes["transformers"].relations
    assert transformers == dict.fromkeys(ON_CT, "holds")
    assert {name: verdict for name, verdict in reference.items() if name != "dequantize"} == {
        "load-twice": "holds",
        "round-trip": "holds",
        "sentinel": "holds",
    }
    # never a silent pass: a path the engine does not have is "not checked", with its reason
    assert reference["dequantize"].startswith("not checked:") and "no 'dequantize' load path" in reference["dequantize"]


def test_transformers_computes_the_same_logits_offloaded_to_disk(session, tmp_path):
    recipe = Recipe(format="fp8-block", arch="llama", config={"num_hidden_layers": 1, "intermediate_size": 256})
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", session, engines=["reference", "transformers"], relations=("offload",))
    assert result.outcomes["transformers"].relations == {"offload": "holds"}, result.findings
    assert "no 'offload' load path" in result.outcomes["reference"].relations["offload"]


def test_autorounds_linears_offloaded_to_disk_compute_the_same_logits(session, tmp_path):
    """AutoRound's FP8 static Linears (which the harness reads by their own dequantization) offloaded
    to disk hold nothing in memory to read: the relation compares their log-probabilities, as for
    any offloaded module (the harness once called their dequantization on `meta` tensors)."""
    pytest.importorskip("auto_round")
    knobs = {"input_scale": True, "scale_dtype": "float32"}
    layout = {"producer_config": "auto-round"}
    recipe = Recipe(format="ct-fp8-channel", arch="llama", config={"num_hidden_layers": 1}, knobs=knobs, layout=layout)
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", session, engines=["reference", "transformers"], relations=("offload",))
    assert result.outcomes["transformers"].relations == {"offload": "holds"}, result.findings


def test_a_relation_the_checkpoint_has_no_path_for_is_not_checked(session, tmp_path):
    directory = small_checkpoint(tmp_path / "c", fmt="modelopt-fp8")
    result = evaluate(directory, session, engines=["reference"], relations=("dequantize",))
    verdict = result.outcomes["reference"].relations["dequantize"]
    assert verdict == "not checked: dequantize applies to quant_method compressed-tensors, fp8, not modelopt"


def test_a_saving_relation_after_another_saves_the_first_load(session, tmp_path):
    """The worker holds a relation's second load (none, where that path is unsupported): a later
    round-trip must save the checkpoint's own load, not what the previous relation left."""
    directory = small_checkpoint(tmp_path / "c", fmt="ct-fp8-channel")
    result = evaluate(directory, session, engines=["reference"], relations=("offload", "round-trip"))
    assert result.outcomes["reference"].relations["round-trip"] == "holds", result.findings
    assert not result.findings


@pytest.mark.parametrize(
    "engine, relation, says",
    [
        (CACHED, "load-twice", "load-twice: model.norm.weight differs at [0]"),
        (
            UNWRITTEN,
            "sentinel",
            "sentinel: model.norm.weight left unwritten: 128/128 element(s) still the NaN sentinel",
        ),
        (LOSSY, "round-trip", "round-trip: "),
    ],
)
def test_buggy_doubles_are_caught_as_relation_findings(session, tmp_path, engine, relation, says):
    directory = small_checkpoint(tmp_path / "c", "float32")
    result = evaluate(directory, session, engines=["reference", engine], relations=(relation,))
    found = [f for f in result.findings if f.kind == "relation"]
    assert [f.engine for f in found] == [engine], [f.message for f in found]
    assert found[0].message.startswith(says), found[0].message
    assert found[0].metrics["relation"] == relation and found[0].module
    assert result.outcomes[engine].relations == {relation: "does not hold"}
    assert result.outcomes["reference"].relations == {relation: "holds"}


def test_an_engine_without_a_forward_here_is_still_held_to_what_it_loaded(tmp_path):
    """vLLM's MoE on a CPU without a kernel: loaded, no forward. The relations compare what it
    loaded (load-twice holds, an unwritten parameter is caught by sentinel), a relation of
    log-probabilities only is not checked, and the engine stays "partly unsupported"."""
    pytest.importorskip("transformers")
    no_forward, unwritten = f"{DOUBLES}:NoForwardEngine", f"{DOUBLES}:NoForwardUnwrittenParameterEngine"
    directory = small_checkpoint(tmp_path / "c", "float32", fmt="fp8-block")
    session = EngineSession(["reference", no_forward, unwritten], tmp_path / "engines")
    try:
        result = evaluate(directory, session, relations=("load-twice", "sentinel", "offload"))
    finally:
        session.close()
    assert result.outcomes[no_forward].relations == {
        "load-twice": "holds",
        "sentinel": "holds",
        "offload": "not checked: the engine has no kernel for the forward here",
    }
    assert result.outcomes[no_forward].detail.startswith("partly unsupported")
    found = [f for f in result.findings if f.kind == "relation"]
    assert [(f.engine, f.metrics["relation"]) for f in found] == [(unwritten, "sentinel")], [f.message for f in found]


def test_compare_checks_the_relations_it_is_asked_for(tmp_path):
    pytest.importorskip("transformers")
    directory = small_checkpoint(tmp_path / "c", "float32")
    done = run_cli("compare", directory, "--engines", f"reference,{CACHED}", "--relations", "load-twice")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "relation load-twice: does not hold" in done.stdout
    assert f"--engines reference,{CACHED} --relations load-twice" in done.stdout  # the reproduction checks it too
    bad = run_cli("compare", directory, "--relations", "load-thrice")
    assert bad.returncode == 2 and "unknown relation" in bad.stderr


def test_transformers_sentinel_storage_leaves_nan_where_it_loaded_nothing(tmp_path):
    """The mechanism behind `sentinel` in transformers: a parameter from_pretrained does not load
    (here the final norm, deleted from the checkpoint) is NaN, not its initial value; computed
    buffers (rotary frequencies) are left as transformers initializes them."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file, save_file

    from harness.engines.transformers_engine import TransformersEngine

    directory = small_checkpoint(tmp_path / "c", "float32")
    for shard in directory.glob("*.safetensors"):
        tensors = load_file(shard)
        if tensors.pop("model.norm.weight", None) is not None:
            save_file(tensors, shard, metadata={"format": "pt"})
    engine = TransformersEngine()
    assert engine.load(str(directory)).missing == ["model.norm.weight"]
    assert torch.equal(engine.model.model.norm.weight, torch.ones(128))  # transformers' initial value
    engine.unload()
    assert engine.load_variant(str(directory), "sentinel").missing == ["model.norm.weight"]
    assert [n for n, p in engine.model.named_parameters() if p.isnan().any()] == ["model.norm.weight"]
    assert torch.isfinite(engine.model.model.rotary_emb.inv_freq).all()


def test_a_reload_under_another_expert_naming_is_compared_part_for_part():
    """A Mixtral checkpoint written with llm-compressor's gate_proj/up_proj/down_proj reloads, once
    saved by transformers, as w1/w3/w2: the same tensors, compared under the first load's names."""
    from harness.differential.relations import expert_parts_as

    tensor = torch.ones(2)
    first = {"model.layers.0.block_sparse_moe.experts.0.down_proj.weight": tensor}
    second = {"model.layers.0.block_sparse_moe.experts.0.w2.weight": tensor, "model.norm.weight": tensor}
    renamed = expert_parts_as(first, second, {"model_type": "mixtral"})
    assert set(renamed) == {"model.layers.0.block_sparse_moe.experts.0.down_proj.weight", "model.norm.weight"}
    assert expert_parts_as(first, second, {"model_type": "llama"}) is second
