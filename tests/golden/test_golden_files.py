"""The gate's rules on synthetic measurements, and the golden file round trip (no engine needed)."""

from __future__ import annotations

import math

import pytest

from harness.core.errors import HarnessError
from harness.gates.gate import GatePolicy, Measurement, gate, judge_against_golden, load_policy
from harness.gates.golden import Golden, read_golden, read_unsupported, write_golden, write_unsupported

PROMPTS = ["a ", "b "]


def golden(ppl=2.0, continuations=((10, 11, 12), (20, 21))):
    return Golden(
        model="m",
        format="fp8-block",
        engine="e",
        perplexity=ppl,
        continuations=[list(c) for c in continuations],
        prompts=PROMPTS,
        texts=["", ""],
    )


EXACT = GatePolicy(perplexity_rel=0.01, text="exact")
TOPK = GatePolicy(perplexity_rel=0.01, text="topk", top_k=2)


def test_perplexity_is_one_sided():
    same = [[10, 11, 12], [20, 21]]
    assert judge_against_golden(Measurement(1.5, same), golden(), EXACT).ok  # better is fine
    assert judge_against_golden(Measurement(2.0199, same), golden(), EXACT).ok
    assert not judge_against_golden(Measurement(2.0201, same), golden(), EXACT).ok
    assert not judge_against_golden(Measurement(math.nan, same), golden(), EXACT).ok
    assert not judge_against_golden(Measurement(math.inf, same), golden(), EXACT).ok


def test_exact_text_fails_on_one_token():
    verdict = judge_against_golden(Measurement(2.0, [[10, 11, 13], [20, 21]]), golden(), EXACT)
    assert not verdict.ok
    assert any("differs" in line for line in verdict.lines)


def test_topk_containment_judges_golden_ranks():
    flipped = [[10, 11, 13], [20, 21]]
    assert judge_against_golden(Measurement(2.0, flipped, golden_ranks=[[0, 0, 1], [0, 0]]), golden(), TOPK).ok
    assert not judge_against_golden(Measurement(2.0, flipped, golden_ranks=[[0, 0, 2], [0, 0]]), golden(), TOPK).ok
    assert not judge_against_golden(Measurement(2.0, flipped, golden_ranks=[]), golden(), TOPK).ok


MARGIN = GatePolicy(perplexity_rel=0.01, text="exact", top_k=2, noise_nat=0.5)


def with_margins(margins=((4.0, 3.0, 0.2), (6.0, 0.7))):
    recorded = golden()
    recorded.margins = [list(m) for m in margins]
    return recorded


def test_exact_above_the_noise_top_k_at_near_ties():
    flipped = [[10, 11, 13], [20, 21]]
    # position 2 of prompt 0 is a near tie (0.2 < 0.5 nat): the golden token may fall to second
    assert judge_against_golden(Measurement(2.0, flipped, golden_ranks=[[0, 0, 1], [0, 0]]), with_margins(), MARGIN).ok
    # but not out of the top-2
    verdict = judge_against_golden(Measurement(2.0, flipped, golden_ranks=[[0, 0, 2], [0, 0]]), with_margins(), MARGIN)
    assert not verdict.ok and "outside the top-2 at [2]" in verdict.lines[1]
    # a confident golden token (0.7 >= 0.5 nat) that is no longer the top-1 fails
    verdict = judge_against_golden(
        Measurement(2.0, [[10, 11, 12], [20, 22]], golden_ranks=[[0, 0, 0], [0, 1]]), with_margins(), MARGIN
    )
    assert not verdict.ok and "not top-1 at [1]" in verdict.lines[2]
    # identical greedy text passes whatever the forced ranks
    assert judge_against_golden(
        Measurement(2.0, [[10, 11, 12], [20, 21]], golden_ranks=[[0, 0, 1], [0, 0]]), with_margins(), MARGIN
    ).ok


def test_a_golden_without_margins_is_judged_by_exact_text():
    flipped = [[10, 11, 13], [20, 21]]
    verdict = judge_against_golden(Measurement(2.0, flipped, golden_ranks=[[0, 0, 1], [0, 0]]), golden(), MARGIN)
    assert not verdict.ok and "no margins" in verdict.lines[1]


def test_every_metric_is_reported_before_the_verdict():
    verdict = judge_against_golden(Measurement(9.0, [[1], [2]]), golden(), EXACT)
    assert verdict.lines[0].startswith("perplexity") and verdict.lines[-1] == "gate: FAIL: perplexity, text"
    assert sum(line.startswith("text") for line in verdict.lines) == 2
    assert verdict.failed == ["perplexity", "text"]


def test_round_trip(tmp_path):
    original = with_margins()
    original.command, original.engine_version, original.isa, original.threads = (
        'python -m harness gate "x"',
        "1.2",
        "amx",
        2,
    )
    path = tmp_path / "m" / "fp8-block" / "e.toml"
    write_golden(original, path)
    back = read_golden(path)
    fields = ("perplexity", "continuations", "prompts", "command", "margins", "isa", "threads", "engine_version")
    assert [getattr(back, f) for f in fields] == [getattr(original, f) for f in fields]
    assert back.date


def test_unknown_golden_key_is_an_error(tmp_path):
    path = tmp_path / "g.toml"
    write_golden(golden(), path)
    path.write_text("surprise = 1\n" + path.read_text())
    with pytest.raises(HarnessError, match="unknown golden key"):
        read_golden(path)


class FixedScorer:
    """Always predicts one token, 5 nat above every other, and generates it (no model needed)."""

    def __init__(self, token=123):  # byte "x"
        self.token = token

    def logprobs(self, sequences):
        import torch

        rows = []
        for s in sequences:
            row = torch.zeros(len(s) - 1, 260)
            row[:, self.token] = 5.0
            rows.append(torch.log_softmax(row, 1))
        return rows

    def generate(self, prompt, max_new_tokens):
        return [self.token] * max_new_tokens


def test_missing_golden_fails_and_update_fails_once(tmp_path):
    assert not gate(FixedScorer(), "m", "fp8-block", "e", root=tmp_path).ok
    written = gate(FixedScorer(), "m", "fp8-block", "e", update=True, root=tmp_path)
    assert not written.ok and "golden written" in written.lines[-1]
    assert gate(FixedScorer(), "m", "fp8-block", "e", root=tmp_path).ok
    assert not gate(FixedScorer(token=124), "m", "fp8-block", "e", root=tmp_path).ok


def test_no_golden_where_the_combination_could_not_run_is_a_skip_until_recorded(tmp_path):
    """A combination golden/unsupported.toml records as unable to run where the goldens were made
    skips (with the reason) instead of failing; recording its golden here drops the record."""
    write_unsupported(
        {
            ("m", "fp8-block", "e"): {
                "model": "m",
                "format": "fp8-block",
                "engine": "e",
                "reason": "no AMX-FP8",
                "isa": "avx512-bf16",
            }
        },
        root=tmp_path,
    )
    skipped = gate(FixedScorer(), "m", "fp8-block", "e", root=tmp_path)
    assert not skipped.ok and "no AMX-FP8" in skipped.skipped and "--engines e" in skipped.skipped
    assert not gate(FixedScorer(), "m", "fp8-block", "other", root=tmp_path).skipped  # not recorded: a failure
    gate(FixedScorer(), "m", "fp8-block", "e", update=True, root=tmp_path)
    assert read_unsupported(root=tmp_path) == {}
    assert gate(FixedScorer(), "m", "fp8-block", "e", root=tmp_path).ok


def test_the_committed_unsupported_records_name_real_combinations():
    from harness.gates.golden import GOLDEN_FORMATS, golden_path
    from harness.lm import MODEL_NAMES

    for model, fmt, engine in read_unsupported():
        assert (
            model in MODEL_NAMES and fmt in GOLDEN_FORMATS and engine in ("transformers", "compressed-tensors", "vllm")
        )
        assert not golden_path(model, fmt, engine).exists(), f"{model}/{fmt}/{engine}: golden and unsupported record"


def test_every_golden_format_has_a_policy():
    from harness.gates.golden import GOLDEN_FORMATS

    for fmt in GOLDEN_FORMATS:
        policy = load_policy(fmt)
        assert policy.perplexity_rel > 0 and policy.reason


def test_the_cli_parser_and_the_registries_import_no_torch():
    """Format and engine names are listed once, in registries the CLI reads without torch (an engine
    package's face, such as harness.engines.sglang's, imports none either)."""
    import subprocess
    import sys

    code = (
        "import sys; from harness.commands.cli import build_parser; build_parser(); "
        "import harness.engines.sglang, harness.engines.sglang.environment; "
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'sglang') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_noise_thresholds_are_what_the_recorded_measurement_justifies():
    """Each engine's noise_nat covers the largest margin move measured across instruction-set
    classes (docs/measurements/gate-noise.json) and is at most twice it: never looser than that."""
    import json
    from pathlib import Path

    recorded = json.loads((Path(__file__).resolve().parents[2] / "docs/measurements/gate-noise.json").read_text())
    largest: dict[str, float] = {}
    for entry in recorded["goldens"]:
        for variant in entry.get("variants", {}).values():
            if "max_abs_dmargin" in variant:
                largest[entry["engine"]] = max(largest.get(entry["engine"], 0.0), variant["max_abs_dmargin"])
    assert {"reference", "transformers", "compressed-tensors", "vllm"} <= set(largest)
    sharing: dict[float, list[str]] = {}
    for engine in largest:
        sharing.setdefault(load_policy("ct-fp8-channel", engine).noise_nat, []).append(engine)
    for noise, engines in sharing.items():
        moved = max(largest[engine] for engine in engines)
        assert moved < noise <= 2 * moved + 1e-6, f"{engines}: noise_nat {noise}, largest measured move {moved}"
