"""The load report's judgement (harness.differential.runner): what an engine reports missing or
unexpected is a finding unless the checkpoint explains it."""


def test_a_redundant_tensor_left_unread_is_not_a_load_report_finding():
    """The load report's judgement excuses unexpected keys whose values the format defines as their
    absence would (Judgement.redundant_tensors), and nothing else."""
    from harness.differential.runner import _judge_report

    found = []
    report = {"missing": [], "unexpected": ["model.layers.0.mlp.down_proj.g_idx"]}
    redundant = {"model.layers.0.mlp.down_proj.g_idx"}
    assert not _judge_report("transformers", report, lambda *a, **k: found.append(a), redundant=redundant)
    assert found == []
    assert _judge_report("transformers", report, lambda *a, **k: found.append(a))
    assert [kind for _, kind, _ in found] == ["load-report"]
