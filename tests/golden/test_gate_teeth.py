"""Gates with teeth: faults injected into otherwise clean variants fail them, on the harness's
reference loader (which loads exactly what the checkpoint says) and on the real engines."""

from __future__ import annotations

import shutil

import pytest

from harness.core.errors import HarnessError
from harness.lm import faults

# The tiny models' most sensitive projections: the last layer's value and output projections
# (dropping one FP8 scale there moves perplexity by orders of magnitude; FACTS.md).
LAST = "model.layers.1"


def faulty(variant, tmp_path, model, fmt, inject):
    directory = tmp_path / "faulty"
    shutil.copytree(variant(model, fmt), directory)
    inject(directory)
    return directory


@pytest.mark.parametrize("engine", ("reference", "transformers"))
@pytest.mark.parametrize("module", (f"{LAST}.self_attn.v_proj", f"{LAST}.self_attn.o_proj", f"{LAST}.mlp.down_proj"))
def test_dropped_fp8_scale_fails(module, engine, engine_session, variant, run_gate, tmp_path):
    directory = faulty(variant, tmp_path, "tiny-qwen2", "fp8-block", lambda d: faults.drop_scale(d, module))
    verdict = run_gate(engine_session, engine, directory, "tiny-qwen2", "fp8-block", update=False)
    assert not verdict.ok, f"\n{verdict}"


@pytest.mark.parametrize("engine", ("reference", "transformers"))
@pytest.mark.parametrize("mode", ("nonfinite", "stale"))
@pytest.mark.parametrize("module", ("model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.q_proj"))
def test_corrupt_bias_fails(module, mode, engine, engine_session, variant, run_gate, tmp_path):
    directory = faulty(variant, tmp_path, "tiny-qwen2", "fp8-block", lambda d: faults.corrupt_bias(d, module, mode))
    verdict = run_gate(engine_session, engine, directory, "tiny-qwen2", "fp8-block", update=False)
    assert not verdict.ok, f"\n{verdict}"


def flipped_global_scale(variant, tmp_path, fmt):
    module = f"{LAST}.self_attn.o_proj"
    return faulty(
        variant, tmp_path, "tiny-qwen2", fmt, lambda d: faults.flip_global_scale_convention(d, module, "weight")
    )


@pytest.mark.parametrize("engine", ("transformers", "compressed-tensors"))
@pytest.mark.parametrize("fmt", ("ct-nvfp4", "ct-nvfp4a16"))
def test_nvfp4_global_scale_in_the_wrong_convention_fails(fmt, engine, engine_session, variant, run_gate, tmp_path):
    directory = flipped_global_scale(variant, tmp_path, fmt)
    verdict = run_gate(engine_session, engine, directory, "tiny-qwen2", fmt, update=False)
    assert not verdict.ok, f"\n{verdict}"


@pytest.mark.parametrize("fmt", ("ct-nvfp4", "ct-nvfp4a16"))
def test_reference_refuses_the_wrong_convention(fmt, engine_session, variant, run_gate, tmp_path):
    """The harness's own loader does what a correct loader must: it refuses, naming the convention."""
    directory = flipped_global_scale(variant, tmp_path, fmt)
    with pytest.raises(HarnessError, match="ModelO"):
        run_gate(engine_session, "reference", directory, "tiny-qwen2", fmt, update=False)
