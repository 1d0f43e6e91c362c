"""Run under the vLLM interpreter by tests/fixes/test_materialize_meta_only.py (not collected):
load one bf16 checkpoint in real vLLM, in-process, five ways, and write what each computed.

    python vllm_materialize_run.py CHECKPOINT QUANTIZATION OUT.json [MODEL:FORMAT:ENGINE] [--runs A,B]

1. `bf16`: no quantization (the reference for "is this garbage").
2. `unbroken`: online quantization with this vLLM's own (fixed) materialize_layer; the post-load
   repair runs in dry-run mode on it and must find nothing.
3. `prefix`: the same with the pre-#41424 materialize_layer put back; the repair runs in dry-run
   mode and says which tensors were clobbered.
4. `prefix+hook`: pre-fix function, then the fix's hook installed around it before loading.
5. `prefix+restore`: pre-fix function, then `restore_clobbered_tensors` after loading.

Given MODEL:FORMAT:ENGINE (e.g. tiny-qwen2:bf16:vllm), each run is also measured by
harness.gates.gate (held-out perplexity, greedy continuations) and, where a golden for it exists,
judged against it (`gate` in its entry: perplexity, continuations, ok and the report lines).
`--runs` loads only the named ones (the CI check: `prefix+hook,prefix+restore`); `prefix+restore`
then also records the dry run before its repair (`restore_dry`) and after it (`restore_after`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.model_loader.reload import layerwise, meta  # noqa: E402

from harness.fixes import materialize_meta_only as fix  # noqa: E402

#: >= 16 tokens: torch's CPU SDPA does not propagate NaN from keys in shorter sequences
PROMPTS = [[1, *range(40, 72)], [1, *b"the cat sat on the mat and the dog sat on the log"]]
NEW_TOKENS = 16


def prefix_materialize_layer(layer, info):
    """vLLM's materialize_layer before PR #41424: every tensor outside the skip set is replaced by
    an empty_strided stand-in, meta or not. The skip set then held only MoE bookkeeping tensors
    (`bias` joined it later, in #49586): 0.32's SKIP_LOAD_TENSORS."""
    if layer.__class__.__name__ in meta.SKIP_MODULES:
        return
    with info.restore_device:
        for name, tensor in meta.get_layer_tensors(layer).items():
            if name not in meta.SKIP_LOAD_TENSORS:
                setattr(layer, name, meta.materialize_meta_tensor(tensor))


def load(checkpoint: str, quantization: str | None) -> LLM:
    config = json.loads(open(os.path.join(checkpoint, "config.json")).read())
    return LLM(
        model=checkpoint,
        tokenizer=checkpoint,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=32 * 2**20,
        max_logprobs=config["vocab_size"],
        seed=0,
        quantization=quantization,
    )


def measure(llm: LLM, vocab: int) -> dict:
    """Full-vocabulary prompt logprobs (as lists, NaN kept as None), greedy continuations, biases."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=vocab, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    logprobs = []
    for output in outputs:
        table = [
            [entries[i].logprob if i in entries else -math.inf for i in range(vocab)]
            for entries in output.prompt_logprobs[1:]
        ]
        logprobs.append([[None if math.isnan(v) else v for v in row] for row in table])
    greedy = SamplingParams(
        max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False
    )
    texts = [
        list(o.outputs[0].token_ids)
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    ]

    def bias_stats(model):
        return {
            name: {
                "max_abs": float(p.detach().float().abs().nan_to_num(float("inf")).max()),
                "nonfinite": int((~torch.isfinite(p.detach().float())).sum()),
            }
            for name, p in model.named_parameters()
            if name.endswith("bias")
        }

    return {"logprobs": logprobs, "greedy": texts, "biases": llm.apply_model(bias_stats)[0]}


def golden_gate(llm: LLM, vocab: int, target: str | None) -> dict | None:
    """harness.gates.gate' measurement of this load (held-out perplexity, greedy continuations of the
    corpus prompts) and, when a golden for `target` exists, the gate's verdict against it."""
    if not target:
        return None
    from harness.engines.vllm.engine import VllmEngine
    from harness.gates.gate import gate, measure
    from harness.gates.golden import golden_path

    model, fmt, engine = target.split(":")
    scorer = VllmEngine()
    scorer.llm, scorer.vocab_size = llm, vocab
    measured = measure(scorer)
    result = {"perplexity": measured.perplexity, "continuations": measured.continuations}
    if not golden_path(model, fmt, engine).is_file():
        return result | {"ok": None, "lines": [f"no golden at {golden_path(model, fmt, engine)}"]}
    verdict = gate(scorer, model, fmt, engine)
    return result | {"ok": verdict.ok, "lines": verdict.lines}


def restore(llm: LLM, checkpoint: str, dry_run: bool) -> dict:
    """The fix's post-load repair on the live model (a dry run only reports)."""
    report = llm.apply_model(lambda model: fix.restore_clobbered_tensors(model, checkpoint, dry_run=dry_run))[0]
    return {"repaired": report.repaired, "skipped": report.skipped, "warnings": report.warnings}


def main(checkpoint: str, quantization: str, out: str, target: str | None = None, only: str = "") -> None:
    vocab = json.loads(open(os.path.join(checkpoint, "config.json")).read())["vocab_size"]
    fixed = layerwise.materialize_layer
    results = {"vllm_fixed_materialize_checks_is_meta": "tensor.is_meta" in open(meta.__file__).read()}
    runs = [
        ("bf16", None, False, False),
        ("unbroken", quantization, False, False),
        ("prefix", quantization, True, False),
        ("prefix+hook", quantization, True, True),
        ("prefix+restore", quantization, True, False),
    ]
    if only:
        runs = [run for run in runs if run[0] in only.split(",")]
    for name, method, prefix, hook in runs:
        start = time.monotonic()
        layerwise.materialize_layer = prefix_materialize_layer if prefix else fixed
        uninstall = fix.install_meta_only_materialize() if hook else None
        try:
            llm = load(checkpoint, method)
        finally:
            if uninstall:
                uninstall()
            layerwise.materialize_layer = fixed
        entry = {}
        if name == "prefix+restore" and only:
            entry["restore_dry"] = restore(llm, checkpoint, dry_run=True)
        if name in ("unbroken", "prefix", "prefix+restore", "prefix+hook"):
            entry["restore"] = restore(llm, checkpoint, dry_run=name != "prefix+restore")
        if name == "prefix+restore" and only:
            entry["restore_after"] = restore(llm, checkpoint, dry_run=True)
        entry.update(measure(llm, vocab))
        entry["gate"] = golden_gate(llm, vocab, target)
        entry["seconds"] = round(time.monotonic() - start, 1)
        results[name] = entry
        del llm
        gc.collect()
    with open(out, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("quantization")
    parser.add_argument("out")
    parser.add_argument("target", nargs="?")
    parser.add_argument("--runs", default="")
    options = parser.parse_args()
    main(options.checkpoint, options.quantization, options.out, options.target, options.runs)
