"""The stand-in lane's tally: what it says it judged is what it judged."""

from harness.differential.stand_in import _findings
from harness.engines.vllm.tensor_parallel import TpResult
from harness.engines.vllm.tensor_parallel.judge import RankVerdict


class Judgement:
    """The part of a judgement `_findings` reads and writes: knobs in, findings out."""

    knobs: dict = {}
    truth: dict = {}

    def __init__(self):
        self.findings = []

    def finding(self, engine, kind, message, **details):
        self.findings.append((engine, kind, message, details))


def _result(*verdicts):
    return {0: TpResult(directory="", vllm="", outcomes=[], verdicts=list(verdicts), kernel_notes=[])}


def test_vocabulary_modules_the_lane_approximates_are_said_not_counted_as_placed_wrong():
    """The lane stands in for the vocabulary modules (docs/tensor-parallel.md): an lm_head a hair
    off is neither a finding nor a Linear "placed wrong" in the tally."""
    judgement = Judgement()
    head = RankVerdict(
        tp=1, rank=0, module="lm_head", status="finding", details=["rel err 3e-08"], wrong={"lm_head": [8, 4]}
    )
    tally = _findings(judgement, "vllm", _result(RankVerdict(tp=1, rank=0, module="qkv_proj", status="exact"), head))
    assert judgement.findings == []
    assert tally.startswith("1/1 Linear(s) placed exactly"), tally
    assert "approximated vocabulary modules, not judged: lm_head" in tally, tally


def test_a_linear_placed_wrong_is_still_a_finding_and_counted():
    judgement = Judgement()
    wrong = RankVerdict(
        tp=1,
        rank=0,
        module="o_proj",
        status="finding",
        details=["rel err 0.5"],
        wrong={"model.layers.0.self_attn.o_proj": [8, 8]},
    )
    tally = _findings(judgement, "vllm", _result(wrong))
    assert [kind for _, kind, _, _ in judgement.findings] == ["weight-mismatch"]
    assert "0/1 Linear(s) placed exactly, 0 refused, 1 placed wrong" in tally, tally


def test_an_unwritten_bias_is_a_finding_an_unwritten_placeholder_is_said():
    """A bias no loader wrote is added by every forward (vllm-gpt-oss-ignores-attention-bias: torch.empty):
    a finding; a placeholder the judge excused (an NVFP4 W4A16 input_scale the checkpoint does not
    store, which the method drops after loading) is only said."""
    judgement = Judgement()
    bias = RankVerdict(
        tp=1, rank=0, module="qkv_proj", status="finding", details=["24 element(s) of bias never written"]
    )
    placeholder = RankVerdict(tp=1, rank=0, module="o_proj", status="exact", placeholders=["input_scale"])
    tally = _findings(judgement, "vllm", _result(bias, placeholder))
    assert [(kind, message) for _, kind, message, _ in judgement.findings] == [
        (
            "weight-mismatch",
            "with stand-in kernels (no kernel here): layer 0 qkv_proj: 24 element(s) of bias never written",
        )
    ]
    assert "1/2 Linear(s) placed exactly, 0 refused, 1 placed wrong" in tally, tally
    assert "parameters never written, not judged: input_scale" in tally, tally
