"""KV-cache scales (harness.checkpoints.kv_scales): every naming is written as its producers write
it, a correct loader passes each, and a loader that knows one naming only (a labelled test
double) is caught on the others and on half a pair."""

from __future__ import annotations

import pytest

from harness.checkpoints.architectures import ARCHITECTURES
from harness.checkpoints.kv_scales import CHOICES, is_kv_scale
from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe, layout_refusal
from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.differential.runner import EngineSession, evaluate
from harness.formats import get_format

DOUBLE = "tests.doubles.buggy_engines:KVScaleNamingEngine"
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96}
FORMAT_OF = {
    "self_attn": "ct-fp8-tensor",
    "output_scale": "ct-fp8-tensor",
    "proj": "modelopt-nvfp4",
    "k-only": "ct-nvfp4",
    "v-only": "ct-fp8-channel",
    "declared-only": "ct-fp8-channel",
}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    pytest.importorskip("transformers")
    session = EngineSession(["reference", DOUBLE], tmp_path_factory.mktemp("engines"))
    yield session
    session.close()


def test_namings_go_with_the_producers_that_write_them():
    llama, phi3, deepseek = (ARCHITECTURES[a] for a in ("llama", "phi3", "deepseek_v3"))

    def carries(kind, arch, name):
        return layout_refusal("kv_scales", kind, get_format(name), arch, {}) is None

    assert carries("proj", llama, "modelopt-nvfp4") and not carries("proj", llama, "ct-fp8-tensor")
    assert carries("output_scale", llama, "ct-int4") and not carries("output_scale", llama, "modelopt-fp8")
    assert not carries("self_attn", llama, "fp8-block")  # nothing in its config declares a KV cache
    assert carries("self_attn", phi3, "ct-fp8-tensor") and not carries("output_scale", phi3, "ct-fp8-tensor")
    assert not carries("self_attn", deepseek, "ct-fp8-tensor")  # latent attention
    with pytest.raises(HarnessError, match="kv_scales=self_attn needs"):
        generate(
            Recipe(format="fp8-block", arch="llama", layout={"kv_scales": "self_attn"}), "/nonexistent/never-written"
        )


@pytest.mark.parametrize("kind", [c for c in CHOICES if c != "none"])
def test_a_correct_loader_passes_and_a_one_naming_loader_is_caught(kind, session, tmp_path):
    recipe = Recipe(format=FORMAT_OF[kind], arch="llama", config=SMALL, layout={"kv_scales": kind})
    generate(recipe, tmp_path / "c")
    checkpoint = Checkpoint(tmp_path / "c")
    scales = {n: checkpoint.tensor(n) for n in checkpoint.names() if is_kv_scale(n)}
    assert len(scales) == {"k-only": 2, "v-only": 2, "declared-only": 0}.get(kind, 4)
    assert len({float(t) for t in scales.values()}) == len(scales)
    assert all(tuple(t.shape) == (() if kind == "proj" else (1,)) for t in scales.values())
    config = checkpoint.quantization_config
    assert config.get("kv_cache_scheme") or config.get("kv_cache_quant_algo") == "FP8"
    result = evaluate(tmp_path / "c", session)
    assert [f for f in result.findings if f.engine == "reference"] == []
    caught = [f for f in result.findings if f.engine == DOUBLE]
    assert bool(caught) == (kind != "self_attn"), [f.message for f in caught]


def test_the_scales_an_engine_uses_are_judged_against_the_stored_pair():
    """harness.differential.kv_scales.judge_module: the stored pair, exactly or rounded once to the
    model dtype, passes; a default, another value, an unquantized cache or a made-up half do not."""
    import torch

    from harness.differential.kv_scales import judge_module

    k, v = 0.0089285714, 0.0133928571  # float32 scales as the generator writes them (amax / 448)
    k32, v32 = (float(torch.tensor(x, dtype=torch.float32)) for x in (k, v))
    kb, vb = (float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16)) for x in (k32, v32))
    module = "model.layers.0.self_attn"
    assert judge_module(module, (k32, v32), (k32, v32), torch.bfloat16) is None
    assert judge_module(module, (k32, v32), (kb, vb), torch.bfloat16) is None
    assert judge_module(module, (k32, v32), (kb, vb), torch.float32) is not None  # float32 holds them exactly
    kind, message = judge_module(module, (k32, v32), (1.0, 1.0), torch.bfloat16)
    assert kind == "kv-scales" and "k_scale 1 where the checkpoint stores 0.00892857" in message
    assert judge_module(module, (k32, v32), (v32, k32), torch.float32)[0] == "kv-scales"  # swapped
    assert "not quantized" in judge_module(module, (k32, v32), None, torch.float32)[1]
    kind, message = judge_module(module, (k32, None), (k32, 1.0), torch.float32)
    assert kind == "accepted-invalid" and "v_scale the checkpoint does not hold" in message
    assert "v_scale 1 (a default)" in message
    assert "v_scale 0.00892857 = the stored k_scale" in judge_module(module, (k32, None), (k32, k32), torch.float32)[1]
    assert judge_module(module, (k32, None), None, torch.float32) is None  # nothing made up
