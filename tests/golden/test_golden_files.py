"""The gate's rules on synthetic measurements, and the golden file round trip (no engine needed)."""

from __future__ import annotations

import math

import pytest

from harness.errors import HarnessError
from harness.gates import GatePolicy, Measurement, gate, judge, load_policy
from harness.golden import Golden, read_golden, write_golden

PROMPTS = ["a ", "b "]


def golden(ppl=2.0, continuations=((10, 11, 12), (20, 21))):
    return Golden(model="m", format="fp8-block", engine="e", perplexity=ppl,
                  continuations=[list(c) for c in continuations], prompts=PROMPTS, texts=["", ""])


EXACT = GatePolicy(perplexity_rel=0.01, text="exact")
TOPK = GatePolicy(perplexity_rel=0.01, text="topk", top_k=2)


def test_perplexity_is_one_sided():
    same = [[10, 11, 12], [20, 21]]
    assert judge(Measurement(1.5, same), golden(), EXACT).ok  # better is fine
    assert judge(Measurement(2.0199, same), golden(), EXACT).ok
    assert not judge(Measurement(2.0201, same), golden(), EXACT).ok
    assert not judge(Measurement(math.nan, same), golden(), EXACT).ok
    assert not judge(Measurement(math.inf, same), golden(), EXACT).ok


def test_exact_text_fails_on_one_token():
    verdict = judge(Measurement(2.0, [[10, 11, 13], [20, 21]]), golden(), EXACT)
    assert not verdict.ok
    assert any("differs" in line for line in verdict.lines)


def test_topk_containment_judges_golden_ranks():
    flipped = [[10, 11, 13], [20, 21]]
    assert judge(Measurement(2.0, flipped, golden_ranks=[[0, 0, 1], [0, 0]]), golden(), TOPK).ok
    assert not judge(Measurement(2.0, flipped, golden_ranks=[[0, 0, 2], [0, 0]]), golden(), TOPK).ok
    assert not judge(Measurement(2.0, flipped, golden_ranks=[]), golden(), TOPK).ok


def test_every_metric_is_reported_before_the_verdict():
    verdict = judge(Measurement(9.0, [[1], [2]]), golden(), EXACT)
    assert verdict.lines[0].startswith("perplexity") and verdict.lines[-1] == "gate: FAIL"
    assert sum(line.startswith("text") for line in verdict.lines) == 2


def test_round_trip(tmp_path):
    original = golden()
    original.command, original.engine_version = 'python -m harness gate "x"', "1.2"
    path = tmp_path / "m" / "fp8-block" / "e.toml"
    write_golden(original, path)
    back = read_golden(path)
    assert (back.perplexity, back.continuations, back.prompts, back.command) == (
        original.perplexity, original.continuations, original.prompts, original.command)
    assert back.date


def test_unknown_golden_key_is_an_error(tmp_path):
    path = tmp_path / "g.toml"
    write_golden(golden(), path)
    path.write_text('surprise = 1\n' + path.read_text())
    with pytest.raises(HarnessError, match="unknown golden key"):
        read_golden(path)


class FixedScorer:
    """Scores every sequence uniformly and generates a fixed continuation (no model needed)."""

    def __init__(self, token=123):  # byte "x"
        self.token = token

    def logprobs(self, sequences):
        import torch

        return [torch.full((len(s) - 1, 260), -math.log(260.0)) for s in sequences]

    def generate(self, prompt, max_new_tokens):
        return [self.token] * max_new_tokens


def test_missing_golden_fails_and_update_fails_once(tmp_path):
    assert not gate(FixedScorer(), "m", "fp8-block", "e", root=tmp_path).ok
    written = gate(FixedScorer(), "m", "fp8-block", "e", update=True, root=tmp_path)
    assert not written.ok and "golden written" in written.lines[-1]
    assert gate(FixedScorer(), "m", "fp8-block", "e", root=tmp_path).ok
    assert not gate(FixedScorer(token=124), "m", "fp8-block", "e", root=tmp_path).ok


def test_every_golden_format_has_a_policy():
    from harness.gate_commands import GOLDEN_FORMATS

    for fmt in GOLDEN_FORMATS:
        policy = load_policy(fmt)
        assert policy.perplexity_rel > 0 and policy.reason


def test_golden_formats_are_every_format():
    from harness.formats import FORMAT_NAMES
    from harness.gate_commands import GOLDEN_FORMATS

    assert tuple(GOLDEN_FORMATS) == tuple(FORMAT_NAMES)
