"""What the subcommands share: exit codes, the --engines and --optional-engines arguments, the line
that reproduces a finding, and a checkpoint's outcomes as printed and as reported. The parser
(harness.commands.cli) imports the subcommands; they import this, never the parser."""

from __future__ import annotations

import os
from pathlib import Path

from harness.core.errors import HarnessError

EXIT_OK, EXIT_FINDING, EXIT_ERROR = 0, 1, 2


def parse_engines(text: str) -> list[str]:
    from harness.engines import engine_spec

    engines = [e.strip() for e in text.split(",") if e.strip()]
    if not engines:
        raise HarnessError("--engines needs at least one engine")
    for engine in engines:
        engine_spec(engine)
    return engines


def start_engines(session, engines: list[str], optional: list[str]) -> None:
    """Start every engine's worker now: one that cannot run (not installed, a loader that does not
    import) stops the command with one line, unless the user named it optional. No silent pass."""
    for engine in engines:
        if session.process(engine) is None and engine not in optional:
            raise HarnessError(
                f"engine {engine} cannot run: {session.unavailable[engine]} (name it in --optional-engines to "
                "go on without it)"
            )


def parse_optional(args, engines: list[str]) -> list[str]:
    optional = [e.strip() for e in (args.optional_engines or "").split(",") if e.strip()]
    strays = [e for e in optional if e not in engines]
    if strays:
        raise HarnessError(f"--optional-engines names {', '.join(strays)}, which --engines does not list")
    return optional


def reproduce_command(directory: Path, engine: str, relation: str | None = None) -> str:
    """The one line that reproduces a finding of `engine` on `directory` (with the plugins it needs;
    with the relation it was found checking, harness.differential.relations)."""
    from harness.core.plugins import VARIABLE
    from harness.engines import judged_with_reference

    plugins = f"{VARIABLE}={os.environ[VARIABLE]} " if os.environ.get(VARIABLE) else ""
    relations = f" --relations {relation}" if relation else ""
    return (
        f"{plugins}python -m harness compare {directory} --engines {','.join(judged_with_reference(engine))}"
        + relations
    )


def checkpoint_json(result) -> dict:
    from dataclasses import asdict

    return {
        "directory": result.directory,
        "format": result.format,
        "expectation": result.expectation,
        "expectation_reason": result.expectation_reason,
        "outcomes": {e: asdict(o) for e, o in result.outcomes.items()},
    }


def print_outcomes(result) -> None:
    why = f": {result.expectation_reason}" if result.expectation_reason else ""
    print(f"{result.directory} ({result.format}, expectation {result.expectation}{why})")
    for engine, outcome in result.outcomes.items():
        ppl = f", perplexity {outcome.perplexity:.4g}" if outcome.perplexity is not None else ""
        detail = f": {outcome.detail}" if outcome.detail else ""
        print(f"  {engine:<20} {outcome.status}{ppl}{detail}")
        for relation, verdict in outcome.relations.items():
            print(f"    relation {relation}: {verdict}")
        if outcome.activation_probe:
            print(f"    activation probe: {outcome.activation_probe}")
        if outcome.effective_weights:
            print(f"    effective weights: {outcome.effective_weights}")
    for item in result.findings:
        tag = f"known issue {item.known_issue}" if item.known_issue else "NEW"
        print(f"  finding [{tag}] {item.engine} {item.kind}: {item.message}")
        if item.command and not item.known_issue:
            print(f"    reproduce: {item.command}")
    if not result.findings:
        print("  no findings: every engine that ran agrees within tolerance")
