"""`python -m harness`: gen, dequant, sweep, compare, run, merge-reports, check, bisect, gate, golden, fixes.

Every user error is one line on stderr and exit 2, except `check` (125, for `git bisect run`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.commands.common import (
    EXIT_ERROR,
    EXIT_FINDING,
    EXIT_OK,
    checkpoint_json,
    parse_engines,
    parse_optional,
    print_outcomes,
    reproduce_command,
    start_engines,
)
from harness.core.errors import HarnessError, Unsupported


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line and exit 2."""

    def error(self, message):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def command_gen(args) -> int:
    from harness.checkpoints.architectures import ARCHITECTURES
    from harness.checkpoints.recipe import Recipe, apply_settings
    from harness.checkpoints.writer import generate
    from harness.formats import require_formats

    require_formats(args.format)
    if args.arch not in ARCHITECTURES:
        raise HarnessError(f"unknown architecture '{args.arch}' (known: {', '.join(ARCHITECTURES)})")
    recipe = apply_settings(Recipe(format=args.format, arch=args.arch, seed=args.seed), args.set or [])
    manifest = generate(recipe, args.out)
    print(
        f"wrote {args.out}: {args.format} {args.arch}, {len(manifest['modules'])} quantized modules, "
        f"expectation {manifest['expectation']}"
    )
    return EXIT_OK


#: --dtype choices of `dequant`
DEQUANT_DTYPES = ("float32", "float64", "bfloat16")


def command_dequant(args) -> int:
    """Stream the reference's dequantized weights into one .safetensors file: memory holds one
    tensor at a time; the file appears under its name only when complete."""
    import torch

    from harness.checkpoints.streaming import StreamingSafetensorsWriter
    from harness.oracle.reference import dequantize_checkpoint, dequantized_names

    out = Path(args.out)
    if not out.parent.is_dir():
        raise HarnessError(f"{out}: its directory does not exist")
    if out.is_dir():
        raise HarnessError(f"{out}: is a directory; --out names the .safetensors file to write")
    dtype = getattr(torch, args.dtype)
    if args.fast and args.dtype == "float64":
        raise HarnessError("--fast writes float32 or bfloat16; float64 is the reference's own path (drop --fast)")
    names = dequantized_names(args.directory)
    if args.fast:
        from harness.oracle.fast import fast_dequantize_checkpoint

        # the writer copies each tensor out before the next is asked for: one output buffer serves all
        tensors = fast_dequantize_checkpoint(args.directory, dtype, reuse_output=True)
    else:
        tensors = dequantize_checkpoint(args.directory)
    temporary = out.with_name(out.name + ".partial")
    try:
        with StreamingSafetensorsWriter(temporary, names, {"format": "pt", "producer": "harness dequant"}) as writer:
            for name, tensor in tensors:
                writer.add(name, tensor.to(dtype))
        os.replace(temporary, out)
    except OSError as error:
        raise HarnessError(f"{out}: cannot write it ({error.strerror or error})") from None
    finally:
        temporary.unlink(missing_ok=True)
    print(f"wrote {out}: {len(names)} tensors, {'fast path, ' if args.fast else ''}{args.dtype}")
    return EXIT_OK


def command_sweep(args) -> int:
    from harness.campaign.sweep import ODD_SIZES, sweep

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise HarnessError(f"{out}: output directory exists and is not empty")
    sizes = ", ".join(f"{k}={v}" for k, v in ODD_SIZES.items())
    print(f"every format x architecture at {sizes}: gen -> dequant from disk -> compare with the truth")
    print(f"{'format':<16} {'arch':<12} {'expectation':<16} {'outcome':<10} max|error|")
    results = sweep(out, args.seed)
    for fmt, arch, verdict in results:
        print(f"{fmt:<16} {arch:<12} {verdict.expectation:<16} {verdict.outcome:<10} {verdict.max_error:.3g}")
    failed = [r for r in results if not r[2].ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return EXIT_FINDING if failed else EXIT_OK


def command_compare(args) -> int:
    import tempfile

    from harness.differential.known_issues import KnownIssues
    from harness.differential.relations import parse_relations
    from harness.differential.report import write_report
    from harness.differential.runner import EngineSession, evaluate
    from harness.engines.process import Limits

    directory = Path(args.directory)
    if not directory.is_dir():
        raise HarnessError(f"{directory}: not a directory")
    engines = parse_engines(args.engines)
    optional = parse_optional(args, engines)
    relations = parse_relations(args.relations)
    known = KnownIssues.load()
    if not args.hostile:  # unusable input stops here, before any engine's worker starts
        from harness.checkpoints.disagreements import misstates_its_index
        from harness.checkpoints.manifest import read_manifest
        from harness.checkpoints.reader import declared_format
        from harness.checkpoints.writer import MANIFEST_FILE
        from harness.oracle.reference import format_and_knobs

        # one the harness wrote to disagree with its own index: its config must be usable
        manifest = read_manifest(directory) if (directory / MANIFEST_FILE).is_file() else None
        (declared_format if misstates_its_index(manifest) else format_and_knobs)(directory)
    with tempfile.TemporaryDirectory(prefix="harness-") as scratch:
        work = Path(args.report) if args.report else Path(scratch)
        session = EngineSession(engines, work / "work", Limits(args.timeout, args.memory_mb))
        try:
            start_engines(session, engines, optional)
            result = evaluate(directory, session, known, hostile=args.hostile, relations=relations)
        finally:
            session.close()
        for item in result.findings:
            item.reproduction = str(directory.resolve())
            item.command = reproduce_command(directory.resolve(), item.engine, item.metrics.get("relation"))
        print_outcomes(result)
        if args.report:
            engines_info = {
                e: {"version": session.versions.get(e, ""), "status": session.unavailable.get(e, "ran")}
                for e in engines
            }
            path = write_report(
                Path(args.report), result.findings, [checkpoint_json(result)], engines_info, f"compare {directory}"
            )
            print(f"report: {path} and {path.with_suffix('.md')}")
    new = [f for f in result.findings if not f.known_issue]
    return EXIT_FINDING if new else EXIT_OK


def command_fixes(args) -> int:
    from harness.fixes import all_fixes

    fixes = all_fixes()
    for fix in fixes:
        print(f"{fix.name}: {fix.repairs}")
        print(f"  applies to: {', '.join(fix.engines)} {fix.versions}; formats {', '.join(fix.formats)}")
        print(f"  detection: {fix.detection}")
        print(
            f"  apply: {fix.apply.__module__}.{fix.apply.__name__}(model, checkpoint_dir)"
            + (f"; hook: {fix.hook.__module__}.{fix.hook.__name__}" if fix.hook else "")
        )
        if fix.known_issues or fix.report:
            print(f"  repairs: {', '.join([*fix.known_issues, *([f'report {fix.report}'] if fix.report else [])])}")
    print(f"{len(fixes)} fix module(s)")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from harness.commands import audit, bisect, check, merge_reports, tp_shards
    from harness.commands import gate as gate_commands
    from harness.commands import run as run_command
    from harness.commands import upstream as upstream_command

    parser = OneLineParser(prog="python -m harness", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    add_gen_parser(commands)
    add_dequant_parser(commands)
    add_compare_parser(commands)
    add_sweep_parser(commands)
    run_command.add_parser(commands)
    check.add_parser(commands)
    upstream_command.add_parser(commands)
    audit.add_parser(commands)
    merge_reports.add_parser(commands)
    bisect.add_parser(commands)
    gate_commands.add_parsers(commands)
    tp_shards.add_parser(commands)
    fixes = commands.add_parser("fixes", help="list the fix modules: what each repairs and when it applies")
    fixes.set_defaults(run=command_fixes)
    return parser


def add_gen_parser(commands) -> None:
    from harness.checkpoints.architectures import ARCHITECTURES
    from harness.formats import FORMAT_NAMES

    gen = commands.add_parser("gen", help="write a synthetic quantized checkpoint with its ground truth")
    gen.add_argument("--format", required=True, help=", ".join(FORMAT_NAMES))
    gen.add_argument("--arch", required=True, help=" or ".join(ARCHITECTURES))
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", required=True, help="output directory (created; must be empty)")
    gen.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="config size (hidden_size=200), format knob (block_size=64), layout (shards=3) "
        "or perturbation (zero_block=true); repeatable",
    )
    gen.set_defaults(run=command_gen)


def add_dequant_parser(commands) -> None:
    dequant = commands.add_parser(
        "dequant",
        help="reference-dequantize a checkpoint to safetensors (float32 by default), one tensor in memory at a time",
    )
    dequant.add_argument("directory", help="checkpoint directory (format detected from config.json)")
    dequant.add_argument("--out", required=True, help="output .safetensors file")
    dequant.add_argument(
        "--dtype",
        choices=DEQUANT_DTYPES,
        default="float32",
        help="dtype written (default float32; float64 keeps the reference's exact values)",
    )
    dequant.add_argument(
        "--fast",
        action="store_true",
        help="float32/bfloat16 fast path (torch's threads), equal to the reference rounded to --dtype; "
        "sampled tiles of every tensor are checked against the float64 reference",
    )
    dequant.set_defaults(run=command_dequant)


def add_compare_parser(commands) -> None:
    from harness.differential.relations import RELATION_NAMES
    from harness.engines import ENGINES

    compare = commands.add_parser("compare", help="load one checkpoint in several engines and judge each")
    compare.add_argument("directory", help="checkpoint directory (generated or not)")
    compare.add_argument(
        "--engines",
        default="reference,transformers",
        help=f"comma-separated: {', '.join(ENGINES)}, or package.module:Class",
    )
    compare.add_argument("--report", help="write OUTDIR/report.json and report.md here")
    compare.add_argument(
        "--optional-engines",
        help="engines (of --engines) that may be unavailable here; any other that cannot run is exit 2",
    )
    compare.add_argument("--timeout", type=float, default=600.0, help="seconds an engine may take per request")
    compare.add_argument("--memory-mb", type=float, default=16000.0, help="resident memory limit per engine worker")
    compare.add_argument(
        "--hostile",
        action="store_true",
        help="when the harness refuses the checkpoint (an index entry or symlink leading outside it, a header "
        "bomb), let each engine load it anyway: one that reads outside or accepts the bomb is a security "
        "finding (docs/hostile.md)",
    )
    compare.add_argument(
        "--relations",
        help=f"comma-separated load paths each engine must agree with bit for bit ({', '.join(RELATION_NAMES)}), "
        "or all; default none (harness.differential.relations)",
    )
    compare.set_defaults(run=command_compare)


def add_sweep_parser(commands) -> None:
    sweep = commands.add_parser(
        "sweep", help="gen + dequant every format x architecture at odd sizes, judged against the recorded truth"
    )
    sweep.add_argument("--out", required=True, help="output directory (created; must be empty)")
    sweep.add_argument("--seed", type=int, default=0)
    sweep.set_defaults(run=command_sweep)


def main(argv: list[str] | None = None) -> int:
    from harness.core.plugins import load_plugins

    try:
        load_plugins()  # before the parser lists the formats and engines a plugin adds
    except HarnessError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except Unsupported as error:  # valid input the harness does not know: said as such, never a finding
        print(f"unsupported: {error}", file=sys.stderr)
        return EXIT_ERROR
    except HarnessError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except Exception as error:  # a bug in the harness: still one line, unless debugging
        if os.environ.get("HARNESS_DEBUG"):
            raise
        print(f"internal error: {type(error).__name__}: {error} (set HARNESS_DEBUG=1 for a traceback)", file=sys.stderr)
        return EXIT_ERROR
