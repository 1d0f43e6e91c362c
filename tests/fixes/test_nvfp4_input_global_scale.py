"""Fix `nvfp4-input-global-scale` (seed 002): an NVFP4 W4A4 activation global scale in the
wrong convention, repaired by one-shot forward pre-hooks after the engine's own processing.

The seed's bug is written exactly: a correct ct-nvfp4 checkpoint from the harness, then every
`input_global_scale` in the safetensors replaced by its reciprocal (the ModelOpt multiplier
amax/2688 in compressed-tensors' divisor slot). The recipe's `global_scale_convention=swapped`
knob swaps the weight scales too, a different (statically detectable) bug.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.fixes import get_fix
from harness.fixes.nvfp4_input_global_scale import (
    FULL_RANGE,
    MARGIN,
    decide,
    flip,
    install_input_scale_prehooks,
)

#: >= 16 tokens (torch's CPU SDPA does not propagate NaN from keys in shorter sequences)
SEQUENCES = [[1, *range(40, 72)], [1, *b"the cat sat on the mat and the dog sat on the log"]]
ROOT = Path(__file__).resolve().parents[2]


def test_declaration():
    fix = get_fix("nvfp4-input-global-scale")
    assert "ct-nvfp4" in fix.formats and fix.hook is install_input_scale_prehooks
    assert fix.report == "002-nvfp4-activation-global-scale"


@pytest.mark.parametrize(
    "stored,amax,verdict",
    [
        (FULL_RANGE / 4.0, 3.9, "correct"),  # the divisor, calibration and input close
        (4.0 / FULL_RANGE, 3.9, "swapped"),  # the multiplier in the divisor slot
        (FULL_RANGE / 4.0, 4.0 / 64, "correct"),  # a short prompt 64x below the calibration amax
        (FULL_RANGE / 30000.0, 30000.0, "correct"),  # real activations above 2688: a divisor < 1
        (30000.0 / FULL_RANGE, 30000.0, "swapped"),
        (FULL_RANGE / 1000.0, 1000.0, "ambiguous"),  # within 8x of 2688: the conventions differ < 64x
        (1000.0 / FULL_RANGE, 1000.0, "ambiguous"),
    ],
)
def test_rule(stored, amax, verdict):
    assert decide(stored, amax).verdict == verdict


def test_rule_waits_for_a_usable_input():
    assert decide(672.0, 0.0) is None and decide(672.0, math.nan) is None


def test_flip_keeps_vllm_derived_values_consistent():
    """vLLM's processed layout: divisor in input_global_scale_inv, its reciprocal in
    input_global_scale, alpha = input_global_scale * weight_global_scale (weight multiplier)."""
    layer = torch.nn.Module()
    wrong_divisor = torch.tensor(4.0 / FULL_RANGE)
    for name, value in {
        "input_global_scale_inv": wrong_divisor,
        "input_global_scale": 1 / wrong_divisor,
        "weight_global_scale": torch.tensor(0.5 / FULL_RANGE),
    }.items():
        layer.register_parameter(name, torch.nn.Parameter(value.clone(), requires_grad=False))
    layer.alpha = torch.nn.Parameter(layer.input_global_scale * layer.weight_global_scale, requires_grad=False)
    flip(layer, "input_global_scale_inv")
    assert torch.allclose(layer.input_global_scale_inv, torch.tensor(FULL_RANGE / 4.0))
    assert torch.allclose(layer.input_global_scale, torch.tensor(4.0 / FULL_RANGE))
    assert torch.allclose(layer.alpha, layer.input_global_scale * layer.weight_global_scale)


def test_hook_fires_once_and_removes_itself():
    layer = torch.nn.Linear(16, 4)
    layer.register_parameter(
        "input_global_scale", torch.nn.Parameter(torch.tensor([4.0 / FULL_RANGE]), requires_grad=False)
    )
    repair = install_input_scale_prehooks(layer)
    layer(torch.zeros(2, 16))  # a profiling-style all-zero input cannot decide
    assert repair.pending == [""] and not repair.report.repaired
    layer(torch.full((2, 16), 3.9))
    assert repair.pending == [] and len(repair.report.repaired) == 1
    assert torch.allclose(layer.input_global_scale, torch.tensor([FULL_RANGE / 4.0]))
    layer(torch.full((2, 16), 3.9))
    assert torch.allclose(layer.input_global_scale, torch.tensor([FULL_RANGE / 4.0])), "fired twice"


def swap_input_global_scales(source: Path, target: Path) -> int:
    """The seed's bug: a copy of `source` whose input_global_scale tensors hold their reciprocal."""
    shutil.copytree(source, target)
    swapped = 0
    for shard in sorted(target.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith(".input_global_scale")]:
            tensors[name] = (1.0 / tensors[name]).to(tensors[name].dtype)
            swapped += 1
        save_file(tensors, shard, metadata={"format": "pt"})
    return swapped


def load_transformers(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()


def load_compressed_tensors(directory: Path):
    from harness.engines import load_engine

    engine = load_engine("compressed-tensors")
    engine.load(str(directory))
    return engine.model


LOADERS = {"transformers": load_transformers, "compressed-tensors": load_compressed_tensors}


@torch.no_grad()
def logprobs(model) -> list[torch.Tensor]:
    return [torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0, :-1].float(), dim=-1) for s in SEQUENCES]


def perplexity(rows: list[torch.Tensor]) -> float:
    nll = torch.cat(
        [-row.gather(1, torch.tensor(s[1:])[:, None]).squeeze(1) for row, s in zip(rows, SEQUENCES, strict=True)]
    )
    return math.exp(float(nll.mean()))


def max_delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().nan_to_num(math.inf).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate

    root = tmp_path_factory.mktemp("nvfp4")
    correct = root / "ct-nvfp4"
    generate(Recipe(format="ct-nvfp4", arch="qwen2", seed=1, config={"num_hidden_layers": 2}), correct)
    assert swap_input_global_scales(correct, root / "swapped") == 14
    return correct, root / "swapped"


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(LOADERS))
def test_swapped_input_scale_is_repaired_before_the_first_forward(synthetic, engine):
    correct_dir, swapped_dir = synthetic
    load = LOADERS[engine]
    reference = logprobs(load(correct_dir))
    broken = logprobs(load(swapped_dir))
    damage = max_delta(broken, reference)
    assert damage > 1.0, f"{engine}: the swapped scales moved logprobs by only {damage}"

    model = load(swapped_dir)  # transformers: still compressed; it decompresses on the first forward
    repair = install_input_scale_prehooks(model)
    repaired = logprobs(model)
    assert repair.pending == [] and not repair.report.warnings, repair.report
    assert len(repair.report.repaired) == 14, repair.report.repaired
    residual = max_delta(repaired, reference)
    # 1/(1/s) in float32 is s or one ulp from it: the repaired model computes the correct one's logits
    assert residual < 1e-2, f"{engine}: repaired logprobs differ from the correct checkpoint's by {residual}"

    applied = get_fix("nvfp4-input-global-scale").apply(load(swapped_dir), swapped_dir, sample_input_ids=SEQUENCES[0])
    assert applied.repaired == repair.report.repaired and not applied.warnings, applied

    clean_model = load(correct_dir)
    clean = install_input_scale_prehooks(clean_model)
    assert max_delta(logprobs(clean_model), reference) == 0.0
    assert clean.report.repaired == [] and clean.report.warnings == [] and clean.pending == []

    # the margins behind MARGIN: both hypotheses far from 1, calibration vs first input close
    worst_side = min(min(abs(d.log_stored), abs(d.log_expected)) for d in clean.decisions.values())
    mismatch = max(abs(d.log_stored - d.log_expected) for d in clean.decisions.values())
    assert worst_side >= math.log(MARGIN) and mismatch < worst_side, (worst_side, mismatch)
    print(
        f"\n{engine}: swapped max|dlogprob| {damage:.3g} -> repaired {residual:.3g}; margins: "
        f"min(|t|,|a|) {worst_side:.2f} (needs {math.log(MARGIN):.2f}), |t-a| <= {mismatch:.2f}"
    )


def tiny_model_available() -> str | None:
    if not (ROOT / "models" / "tiny-qwen2" / "model.safetensors").is_file():
        return "models/tiny-qwen2 is not committed yet"
    try:
        import harness.gates.gate  # noqa: F401
        import harness.lm.quantize  # noqa: F401
    except ImportError as error:
        return f"harness.gates.gate / harness.lm.quantize missing: {error}"
    return None


@pytest.mark.slow
@pytest.mark.skipif(tiny_model_available() is not None, reason=str(tiny_model_available()))
def test_gate_tiny_qwen2_ct_nvfp4_transformers(tmp_path):
    """The trained model, quantized by harness.lm: the swapped checkpoint's held-out perplexity and
    text (harness.gates.gate.measure) are far off the correct one's; the repaired load's are the correct
    load's exactly; where the golden of (tiny-qwen2, ct-nvfp4, transformers) exists, the swapped load
    fails the gate and the repaired one passes it."""
    from harness.gates.gate import ModelScorer, gate_model, measure
    from harness.gates.golden import golden_path
    from harness.lm import quantize_model

    correct = tmp_path / "tiny-qwen2-ct-nvfp4"
    quantize_model("tiny-qwen2", "ct-nvfp4", correct)
    swapped = tmp_path / "swapped"
    assert swap_input_global_scales(correct, swapped) == 14

    reference = measure(ModelScorer(load_transformers(correct)))
    broken = measure(ModelScorer(load_transformers(swapped)))
    model = load_transformers(swapped)
    repair = install_input_scale_prehooks(model)
    fixed = measure(ModelScorer(model))
    margins = [
        (min(abs(d.log_stored), abs(d.log_expected)), abs(d.log_stored + d.log_expected))
        for d in repair.decisions.values()
    ]
    print(
        f"\ntiny-qwen2 ct-nvfp4 transformers: perplexity correct {reference.perplexity:.5g}, swapped "
        f"{broken.perplexity:.5g}, repaired {fixed.perplexity:.5g}; margins min(|t|,|a|) "
        f"{min(m for m, _ in margins):.2f} (needs {math.log(MARGIN):.2f}), calibration vs first input amax "
        f"|ln(amax_cal/amax_x)| <= {max(d for _, d in margins):.2f}"
    )
    assert repair.pending == [] and len(repair.report.repaired) == 14 and not repair.report.warnings, repair.report
    assert not broken.perplexity < 1.5 * reference.perplexity, (broken.perplexity, reference.perplexity)
    assert fixed.perplexity == reference.perplexity and fixed.continuations == reference.continuations

    if golden_path("tiny-qwen2", "ct-nvfp4", "transformers").is_file():
        failing = gate_model(load_transformers(swapped), "tiny-qwen2", "ct-nvfp4", "transformers")
        model = load_transformers(swapped)
        install_input_scale_prehooks(model)
        verdict = gate_model(model, "tiny-qwen2", "ct-nvfp4", "transformers")
        print("gate, swapped:\n  " + "\n  ".join(failing.lines) + "\ngate, repaired:\n  " + "\n  ".join(verdict.lines))
        assert not failing.ok, str(failing)
        assert verdict.ok, str(verdict)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM has no CPU kernel for NVFP4: this runs on a CUDA GPU")
def test_vllm_gpu_swapped_input_scale_repaired(tmp_path):
    """Through vLLM: the pre-hooks installed on the loaded model (after process_weights_after_loading)
    repair input_global_scale_inv, input_global_scale and alpha before the first forward."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate

    # a shape vLLM runs as transformers does (see tests/engines/test_vllm_engine.py: ALIGNED)
    aligned = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
    }
    correct_dir, swapped_dir = tmp_path / "ct-nvfp4", tmp_path / "swapped"
    generate(Recipe(format="ct-nvfp4", arch="llama", seed=1, config=aligned), correct_dir)
    swap_input_global_scales(correct_dir, swapped_dir)
    params = SamplingParams(max_tokens=1, prompt_logprobs=20, detokenize=False)

    def run(directory, fix):
        llm = LLM(
            model=str(directory),
            tokenizer=str(directory),
            enforce_eager=True,
            max_model_len=256,
            gpu_memory_utilization=0.3,
            max_logprobs=20,
            seed=0,
        )
        reports = llm.apply_model(lambda model: install_input_scale_prehooks(model).report) if fix else None
        out = llm.generate([{"prompt_token_ids": s} for s in SEQUENCES], params, use_tqdm=False)
        top = [
            [max(entries.items(), key=lambda kv: kv[1].logprob)[0] for entries in o.prompt_logprobs[1:]] for o in out
        ]
        del llm
        return top, reports

    reference, _ = run(correct_dir, False)
    broken, _ = run(swapped_dir, False)
    fixed, reports = run(swapped_dir, True)
    assert broken != reference, "the swapped scales changed no top-1 token"
    assert fixed == reference, reports
