"""A worker whose load imported a package that changes every later load in its process (auto-round
patches transformers) is restarted before it loads another checkpoint: what an engine is judged on
never depends on what its worker loaded before (harness.engines.worker.PROCESS_CHANGING_PACKAGES)."""

from __future__ import annotations

import pytest

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.engines import engine_spec
from harness.engines.process import EngineError, EngineProcess, Limits

pytest.importorskip("transformers")
pytest.importorskip("auto_round")
SIZES = {"num_hidden_layers": 1}


def test_a_load_after_an_auto_round_one_is_as_it_would_be_first(tmp_path):
    modelopt, autoround = tmp_path / "modelopt", tmp_path / "autoround"
    generate(
        Recipe(
            format="ct-fp8-channel",
            arch="qwen3_moe",
            config=SIZES,
            knobs={"scale_dtype": "float32"},
            layout={"producer_config": "modelopt"},
        ),
        modelopt,
    )
    generate(
        Recipe(format="ct-nvfp4", arch="qwen3_moe", config=SIZES, layout={"producer_config": "auto-round"}), autoround
    )
    worker = EngineProcess(engine_spec("transformers"), None, tmp_path / "worker.log", Limits(timeout_s=300))
    worker.start()
    try:
        first = worker.load(modelopt)
        pids = [worker.process.pid]
        worker.load(autoround)
        changed_by = worker.changed_by
        worker.load(autoround)  # the same checkpoint again (load-twice): the same worker
        pids.append(worker.process.pid)
        again = worker.load(modelopt)
        pids.append(worker.process.pid)
    finally:
        worker.close()
    # without the restart, Qwen3-MoE's per-expert tensors are no longer packed: experts missing
    assert not first["missing"] and again == first
    assert changed_by == "auto_round" and pids[0] == pids[1] != pids[2]


def test_a_load_that_failed_after_the_import_restarts_the_worker_too(tmp_path):
    """transformers with auto-round fails an AutoRound int4 checkpoint at its first forward (the
    Linear auto-round's CPU backend cannot take: a known issue), after auto-round was imported: that
    worker has changed as much as one whose load succeeded."""
    modelopt, crashing = tmp_path / "modelopt", tmp_path / "crashing"
    knobs = {"scale_dtype": "float32"}
    layout = {"producer_config": "modelopt"}
    generate(Recipe(format="ct-fp8-channel", arch="qwen3_moe", config=SIZES, knobs=knobs, layout=layout), modelopt)
    # 160 inputs in groups of 128 (down_proj): auto-round's fallback Linear crashes at the first token
    generate(Recipe(format="gptq", arch="llama", config=SIZES, layout={"producer_config": "auto-round"}), crashing)
    worker = EngineProcess(engine_spec("transformers"), None, tmp_path / "worker.log", Limits(timeout_s=300))
    worker.start()
    try:
        with pytest.raises(EngineError, match="unsupported operand type"):
            worker.load(crashing)
        changed_by, pid = worker.changed_by, worker.process.pid
        report = worker.load(modelopt)
        restarted = worker.process.pid != pid
    finally:
        worker.close()
    assert changed_by == "auto_round" and restarted
    assert not report["missing"]
