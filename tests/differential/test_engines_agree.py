"""The differential suite: Hypothesis draws checkpoints, each engine loads them, and every
finding must be explained by a known upstream issue. Runs on the engines given by
--harness-engines; an engine that cannot run here is skipped with its reason."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings

from harness.campaign.strategies import recipes
from harness.checkpoints.writer import generate
from harness.differential.runner import evaluate
from harness.engines import ENGINE_NAMES
from harness.formats import FORMAT_NAMES
from harness.pytest_plugin import require_engine

ENGINES = [name for name in ENGINE_NAMES if name != "reference"]


def explain(result, new) -> str:
    recipe = json.loads((Path(result.directory) / "harness_manifest.json").read_text())["recipe"]
    lines = [f"{f.engine} {f.engine_version} {f.kind} ({f.format}): {f.message}" for f in new]
    return "\n".join(lines + [f"recipe: {json.dumps(recipe)}"])


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_agrees_with_the_reference(engine, engine_session, known_issues):
    worker = require_engine(engine_session, engine)
    supported = tuple(f for f in FORMAT_NAMES if not worker.unsupported(f))
    if not supported:
        pytest.skip(f"{engine} supports none of the formats here")

    @settings(max_examples=min(settings.default.max_examples, 12))
    @given(recipes(formats=supported))
    def check(recipe):
        with tempfile.TemporaryDirectory() as scratch:
            directory = Path(scratch) / "checkpoint"
            generate(recipe, directory)
            result = evaluate(directory, engine_session, known_issues, ["reference", engine])
            new = [f for f in result.findings if not f.known_issue]
            assert not new, explain(result, new)

    check()
