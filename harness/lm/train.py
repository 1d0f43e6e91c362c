"""Train a tiny model on the grammar corpus and write its bfloat16 checkpoint.

    python -m harness.lm.train tiny-qwen2 [--out DIR]

Deterministic on one machine: fixed seeds, deterministic algorithms, one thread. The
checkpoint's training.json records the command, versions, losses and the weights' SHA-256,
so a retrain can be checked bit for bit (`--verify`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

from harness.core.errors import HarnessError
from harness.lm import corpus
from harness.lm.models import MODELS_ROOT, model_spec

TRAIN_CHARS = 200_000
SEQUENCE, BATCH = 128, 16
LEARNING_RATE, WARMUP = 3e-3, 50
THREADS = 2


def build_model(spec):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.checkpoints.architectures import ARCHITECTURES

    arch = ARCHITECTURES[spec.arch]
    raw = arch.config_json(arch.settings(spec.config), "bfloat16")
    config = AutoConfig.for_model(**raw)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.bias_init_std:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("_proj.bias"):
                    parameter.normal_(0.0, spec.bias_init_std)
    return model, raw


def heldout_perplexity(model) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for sequence in corpus.heldout_sequences():
            ids = torch.tensor([sequence])
            logits = model(input_ids=ids).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(sequence) - 1
    return math.exp(total / count)


def train(name: str, out: Path) -> dict:
    import torch

    spec = model_spec(name)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    model, raw_config = build_model(spec)
    data = torch.tensor(corpus.encode(corpus.text(corpus.TRAIN_SEED, TRAIN_CHARS)))
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)

    def rate(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (spec.steps - WARMUP)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    started, losses = time.monotonic(), []
    model.train()
    for step in range(spec.steps):
        starts = torch.randint(0, len(data) - SEQUENCE - 1, (BATCH,), generator=generator)
        batch = torch.stack([data[s : s + SEQUENCE + 1] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == spec.steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f} ({time.monotonic() - started:.0f} s)", flush=True)
    model.eval()
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save(model, raw_config, out)
    record = {
        "model": name,
        "command": f"python -m harness.lm.train {name}",
        "arch": spec.arch,
        "config": spec.config,
        "bias_init_std": spec.bias_init_std,
        "steps": spec.steps,
        "seed": spec.seed,
        "threads": THREADS,
        "sequence": SEQUENCE,
        "batch": BATCH,
        "learning_rate": LEARNING_RATE,
        "warmup": WARMUP,
        "train_chars": TRAIN_CHARS,
        "final_train_loss": round(sum(losses[-20:]) / 20, 4),
        "heldout_perplexity_bf16": round(heldout_perplexity(model), 4),
        "seconds": round(time.monotonic() - started, 1),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "sha256": digest(out / "model.safetensors"),
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def save(model, raw_config: dict, out: Path) -> None:
    from safetensors.torch import save_file

    from harness.checkpoints.tokenizer import write_tokenizer

    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw_config, indent=1) + "\n")
    write_tokenizer(out, raw_config["vocab_size"])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.lm.train", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="tiny-qwen2 or tiny-llama")
    parser.add_argument("--out", help="output directory (default: models/NAME, the committed copy)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="retrain into --out (or a scratch directory) and compare with the committed weights",
    )
    args = parser.parse_args(argv)
    try:
        spec = model_spec(args.model)
        committed = MODELS_ROOT / spec.name
        if args.verify:
            import tempfile

            expected = json.loads((committed / "training.json").read_text())["sha256"]
            with tempfile.TemporaryDirectory() as scratch:
                record = train(spec.name, Path(args.out or scratch))
            same = record["sha256"] == expected
            print(f"retrained {spec.name}: sha256 {record['sha256']} {'==' if same else '!='} committed {expected}")
            return 0 if same else 1
        record = train(spec.name, Path(args.out) if args.out else committed)
    except (HarnessError, OSError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
