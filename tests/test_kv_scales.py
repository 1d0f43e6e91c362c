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
    assert len(scales) == (2 if kind == "k-only" else 4) and len({float(t) for t in scales.values()}) == len(scales)
    assert all(tuple(t.shape) == (() if kind == "proj" else (1,)) for t in scales.values())
    config = checkpoint.quantization_config
    assert config.get("kv_cache_scheme") or config.get("kv_cache_quant_algo") == "FP8"
    result = evaluate(tmp_path / "c", session)
    assert [f for f in result.findings if f.engine == "reference"] == []
    caught = [f for f in result.findings if f.engine == DOUBLE]
    assert bool(caught) == (kind != "self_attn"), [f.message for f in caught]
