"""`quantize`, `ppl`, `gate` and `golden`: the tiny models' quantized variants and their golden gates.

A gate checks the engine's weights against the reference dequantization of the checkpoint it
loaded (or says why it could not), then perplexity and text against the golden; the verdict line
names the checks that failed (harness/gates/gate.py, docs/golden.md).

Exit codes of `gate` and `golden`: 0 every gate passed (`golden`: or was skipped), 1 a gate failed
(or a golden was just written, or is missing), 2 an error (bad input, engine unavailable for a
single `gate`); `gate` 125 (git bisect's "cannot test"): no golden, and golden/unsupported.toml
records that this combination could not run where the goldens were recorded.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

from harness.core.errors import HarnessError
from harness.engines import ENGINE_NAMES
from harness.formats import require_formats
from harness.gates.golden import GOLDEN_FORMATS, OTHER_READERS
from harness.gates.scoring import loaded_scorer, provenance, unsupported_record

EXIT_OK, EXIT_FAIL, EXIT_ERROR, EXIT_UNTESTABLE = 0, 1, 2, 125


def command_quantize(args) -> int:
    from harness.lm import quantize_model

    out = quantize_model(args.model, args.format, args.out, producer=args.producer)
    print(f"wrote {out}: {args.model} in {args.format} (producer {args.producer})")
    return EXIT_OK


@contextmanager
def scorer_for(args, directory: Path, fmt: str):
    """`directory` loaded in `args.engine`'s worker, as a Scorer; the session, for its version."""
    from harness.differential.runner import EngineSession
    from harness.engines.process import Limits

    with tempfile.TemporaryDirectory(prefix="harness-gate-") as scratch:
        session = EngineSession([args.engine], Path(scratch), Limits(args.timeout, args.memory_mb))
        try:
            scorer, why = loaded_scorer(session, args.engine, directory, fmt)
            if scorer is None:
                raise HarnessError(f"{args.engine} {why}")
            yield scorer, session
        finally:
            session.close()


def existing_directory(text: str) -> Path:
    directory = Path(text)
    if not directory.is_dir():
        raise HarnessError(f"{directory}: not a directory")
    return directory


def command_ppl(args) -> int:
    from harness.checkpoints.reader import Checkpoint
    from harness.gates.gate import measure
    from harness.lm.corpus import PROMPTS, decode
    from harness.oracle.reference import format_and_knobs

    directory = existing_directory(args.directory)
    unquantized = "quantization_config" not in Checkpoint(directory).config
    fmt = "bf16" if unquantized else format_and_knobs(directory)[0].name
    with scorer_for(args, directory, fmt) as (scorer, session):
        measured = measure(scorer)
        version = session.versions.get(args.engine, "")
    print(f"{directory} ({fmt}) in {args.engine} {version}")
    print(f"perplexity {measured.perplexity:.5g} on the held-out slice")
    for prompt, tokens in zip(PROMPTS, measured.continuations, strict=True):
        print(f"  {prompt!r} -> {decode(tokens)!r}")
    return EXIT_OK


def command_gate(args) -> int:
    from harness.gates.gate import gate
    from harness.lm.quantize import model_and_format

    directory = existing_directory(args.directory)
    model, fmt = model_and_format(directory)
    with scorer_for(args, directory, fmt) as (scorer, session):
        command = f"python -m harness gate {directory} --engine {args.engine} --update-golden"
        verdict = gate(
            scorer,
            model,
            fmt,
            args.engine,
            update=args.update_golden,
            provenance=provenance(session, args.engine, "harness", command),
        )
    print(f"{model} / {fmt} / {args.engine}")
    print(verdict)
    if verdict.skipped:
        return EXIT_UNTESTABLE
    return EXIT_OK if verdict.ok else EXIT_FAIL


def summary(verdict) -> str:
    """One line per gate for `golden`: PASS or FAIL, the perplexity line, the weight check's status."""
    perplexity = next((line for line in verdict.lines if line.startswith("perplexity")), verdict.lines[0])
    weights = f"; {verdict.weights.short}" if verdict.weights is not None else ""
    return f"{'PASS' if verdict.ok else 'FAIL'}: {perplexity}{weights}"


def command_golden(args) -> int:
    """Gate (or with --update, regenerate) every model x format x engine."""
    from harness.differential.runner import EngineSession
    from harness.engines import engine_spec
    from harness.engines.process import Limits
    from harness.gates.gate import gate
    from harness.gates.golden import orphaned_goldens, read_unsupported, write_unsupported
    from harness.lm import MODEL_NAMES, model_spec, quantize_model

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for engine in engines:
        engine_spec(engine)
    models = [m.strip() for m in args.models.split(",")] if args.models else list(MODEL_NAMES)
    formats = [f.strip() for f in args.formats.split(",")] if args.formats else list(GOLDEN_FORMATS)
    for model in models:
        model_spec(model)
    require_formats(*formats)
    failed, skipped, expected = 0, 0, set()
    could_not_run = {}
    with tempfile.TemporaryDirectory(prefix="harness-golden-") as scratch:
        session = EngineSession(engines, Path(scratch) / "work", Limits(args.timeout, args.memory_mb))
        try:
            for model in models:
                for fmt in formats:
                    directory = quantize_model(model, fmt, Path(scratch) / f"{model}-{fmt}")
                    for engine in engines:
                        scorer, why = loaded_scorer(session, engine, directory, fmt)
                        if scorer is None:
                            print(f"{model:<11} {fmt:<15} {engine:<19} skipped ({why[:90]})")
                            if why.startswith("unsupported: "):
                                could_not_run[(model, fmt, engine)] = unsupported_record(
                                    session, model, fmt, engine, why
                                )
                            continue
                        expected.add((model, fmt, engine))
                        command = (
                            f"python -m harness golden --update --models {model} --formats {fmt} --engines {engine}"
                        )
                        verdict = gate(
                            scorer,
                            model,
                            fmt,
                            engine,
                            update=args.update,
                            provenance=provenance(session, engine, "harness", command),
                        )
                        if verdict.skipped:
                            skipped += 1
                            print(f"{model:<11} {fmt:<15} {engine:<19} SKIP: {verdict.skipped}")
                            continue
                        failed += not verdict.ok
                        print(f"{model:<11} {fmt:<15} {engine:<19} {summary(verdict)}")
                        if not verdict.ok:
                            print(
                                "\n".join("    " + line for line in verdict.lines if not line.startswith("perplexity"))
                            )
        finally:
            session.close()
    if args.update and could_not_run:
        write_unsupported(read_unsupported() | could_not_run)
        print(f"recorded {len(could_not_run)} combination(s) that cannot run here in golden/unsupported.toml")
    if not args.models and not args.formats:
        for path in orphaned_goldens(expected | set(OTHER_READERS)):
            print(f"orphaned golden (no gate reads it here): {path}")
    print(f"{len(expected) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return EXIT_FAIL if failed else EXIT_OK


def add_parsers(commands) -> None:
    quantize = commands.add_parser("quantize", help="quantize a tiny trained model into a format")
    quantize.add_argument("model", help="tiny-qwen2 or tiny-llama")
    quantize.add_argument("--format", required=True)
    quantize.add_argument("--out", required=True, help="output directory (created; must be empty)")
    quantize.add_argument("--producer", default="harness", choices=["harness", "compressed-tensors"])
    quantize.set_defaults(run=command_quantize)

    for name, function, text in (
        ("ppl", command_ppl, "perplexity on the held-out slice and greedy continuations"),
        ("gate", command_gate, "judge a tiny model's variant against its goldens (exit 0 pass, 1 fail, 2 error)"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("directory")
        sub.add_argument("--engine", default="reference")
        sub.add_argument("--timeout", type=float, default=600.0)
        sub.add_argument("--memory-mb", type=float, default=16000.0)
        if name == "gate":
            sub.add_argument(
                "--update-golden",
                action="store_true",
                help="rewrite the golden from this run (the gate still fails once)",
            )
        sub.set_defaults(run=function)

    golden = commands.add_parser("golden", help="gate every tiny model x format x engine; report orphaned goldens")
    golden.add_argument("--engines", default=",".join(ENGINE_NAMES))
    golden.add_argument("--models")
    golden.add_argument("--formats")
    golden.add_argument("--update", action="store_true", help="regenerate the goldens (every gate fails once)")
    golden.add_argument("--timeout", type=float, default=600.0)
    golden.add_argument("--memory-mb", type=float, default=16000.0)
    golden.set_defaults(run=command_golden)
