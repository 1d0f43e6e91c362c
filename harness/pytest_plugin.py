"""pytest plugin (entry point `harness`): engines as fixtures, the `needs_engine` marker, options.

    pytest --harness-engines reference,transformers,vllm

An engine that cannot run here (package absent, no interpreter for it) is skipped with the
reason, never silently. Heavy imports happen inside fixtures, not at plugin load.
"""

from __future__ import annotations

import pytest

from harness.engines import ENGINE_NAMES

DEFAULT_ENGINES = ",".join(ENGINE_NAMES)


def pytest_addoption(parser):
    group = parser.getgroup("harness", "quantized-checkpoint loading harness")
    group.addoption(
        "--harness-engines",
        default=DEFAULT_ENGINES,
        help=f"engines the differential suite runs (default {DEFAULT_ENGINES})",
    )
    group.addoption("--harness-timeout", type=float, default=600.0, help="seconds per engine request")
    group.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite the goldens the gates read (each rewritten gate fails once, for review)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_engine(name): skip unless the named engine can run here")


@pytest.fixture(scope="session")
def harness_engines(pytestconfig) -> list[str]:
    return [e.strip() for e in pytestconfig.getoption("--harness-engines").split(",") if e.strip()]


@pytest.fixture(scope="session")
def engine_session(harness_engines, tmp_path_factory, pytestconfig):
    """One worker per engine for the whole test session (imports are paid once)."""
    from harness.differential.runner import EngineSession
    from harness.engines.process import Limits

    session = EngineSession(
        harness_engines,
        tmp_path_factory.mktemp("engines"),
        Limits(timeout_s=pytestconfig.getoption("--harness-timeout")),
    )
    yield session
    session.close()


@pytest.fixture(scope="session")
def update_golden(pytestconfig) -> bool:
    return bool(pytestconfig.getoption("--update-golden"))


@pytest.fixture(scope="session")
def known_issues():
    from harness.differential.known_issues import KnownIssues

    return KnownIssues.load()


def require_engine(session, engine: str):
    """The engine's worker, or a skip that says why it cannot run here."""
    if engine not in session.engines:
        pytest.skip(f"engine {engine} not selected (--harness-engines)")
    worker = session.process(engine)
    if worker is None:
        pytest.skip(f"engine {engine} unavailable: {session.unavailable[engine]}")
    return worker


@pytest.fixture(autouse=True)
def _needs_engine(request):
    marker = request.node.get_closest_marker("needs_engine")
    if marker is not None:
        require_engine(request.getfixturevalue("engine_session"), marker.args[0])
