"""pytest plugin (entry point `harness`): engines as fixtures, the `needs_engine` marker, options,
and a sharded campaign as test items.

    pytest --harness-engines reference,transformers,vllm
    pytest -p xdist -n 4 --harness-campaign-shards 4 --harness-campaign-args "--max-examples 100"

An engine that cannot run here (package absent, no interpreter for it) is skipped with the
reason, never silently. Heavy imports happen inside fixtures, not at plugin load.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

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
    group.addoption(
        "--harness-campaign-shards",
        type=int,
        default=0,
        metavar="N",
        help="collect only N items `campaign shard I/N`, each a `python -m harness run --shard I/N` "
        "(spread over xdist workers with -p xdist -n N); the shard reports are merged at the end",
    )
    group.addoption(
        "--harness-campaign-args",
        default="",
        metavar="ARGS",
        help='more arguments for every shard\'s `python -m harness run` (one string, e.g. "--engines reference,vllm")',
    )
    group.addoption(
        "--harness-campaign-out",
        default="out/campaign-shards",
        metavar="DIR",
        help="shard I reports to DIR/shard-I (its output in DIR/shard-I.log), the merged report to DIR/merged",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_engine(name): skip unless the named engine can run here")
    shards = config.getoption("--harness-campaign-shards")
    if shards < 0:
        raise pytest.UsageError("--harness-campaign-shards: give a number of shards, 1 or more")
    try:
        shlex.split(config.getoption("--harness-campaign-args"))
    except ValueError as error:
        raise pytest.UsageError(f"--harness-campaign-args: {error}") from None
    if shards and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(CampaignMerge(config), "harness-campaign-merge")


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


# The sharded campaign: N items, each one `python -m harness run --shard I/N` in a subprocess; the
# controller (not an xdist worker) merges the shards' reports when the session ends.

SHARD_NAME = re.compile(r"^campaign shard (\d+)/(\d+)$")


def campaign_out(config) -> Path:
    return (config.invocation_params.dir / config.getoption("--harness-campaign-out")).resolve()


def shard_command(index: int, total: int, report: Path, args: list[str]) -> list[str]:
    """The shard's command line: this interpreter, the caller's environment (inherited)."""
    return [sys.executable, "-m", "harness", "run", "--shard", f"{index}/{total}", "--report", str(report), *args]


class CampaignShardFailed(Exception):
    """A shard exited non-zero: the message is the item's whole failure text."""


class CampaignShard(pytest.Item):
    def __init__(self, *, index: int, total: int, **kwargs):
        super().__init__(**kwargs)
        self.index, self.total = index, total

    def runtest(self) -> None:
        out = campaign_out(self.config)
        report = out / f"shard-{self.index}"
        report.mkdir(parents=True, exist_ok=True)
        for stale in ("report.json", "report.md"):  # a report left by an earlier session is not this one's
            (report / stale).unlink(missing_ok=True)
        log = out / f"shard-{self.index}.log"
        args = shlex.split(self.config.getoption("--harness-campaign-args"))
        command = shard_command(self.index, self.total, report, args)
        with log.open("w") as handle:
            handle.write(f"$ {shlex.join(command)}\n")
            handle.flush()
            code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
        self.user_properties += [("report", str(report)), ("log", str(log))]
        if code != 0:
            raise CampaignShardFailed(self.failure_text(code, report, log))

    def failure_text(self, code: int, report: Path, log: Path) -> str:
        head = f"{self.name}: exit {code}"
        where = f"report: {report / 'report.md'}, output: {log}"
        new = new_findings(report) if code == 1 else None
        if new:
            count = sum(1 for line in new if line.startswith("NEW "))
            return "\n".join([f"{head}, {count} new finding(s) ({where})", *new])
        why = {1: "findings", 2: "an error"}.get(code, "the harness crashed or was killed")
        tail = log.read_text(errors="replace").splitlines()[-15:]
        return "\n".join([f"{head} ({why}; {where}); the output's last lines:", *tail])

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CampaignShardFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, self.name


def new_findings(report: Path) -> list[str]:
    """Each new finding of a shard's report.json in two lines (what, and how to reproduce it)."""
    try:
        findings = json.loads((report / "report.json").read_text())["findings"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    lines = []
    for item in findings:
        if item.get("known_issue"):
            continue
        lines.append(f"NEW {item.get('engine')} {item.get('kind')} ({item.get('format')}): {item.get('message')}")
        if item.get("command"):
            lines.append(f"    reproduce: {item['command']}")
    return lines


def pytest_collection(session):
    """In campaign mode the items are the shards and nothing else is collected (no test module is
    imported). xdist's controller collects nothing (its `dsession` plugin says so); its workers
    and a run without xdist collect here, and run the collection hooks as pytest's own would."""
    config = session.config
    total = config.getoption("--harness-campaign-shards")
    if not total or config.pluginmanager.has_plugin("dsession"):
        return None
    from _pytest.reports import CollectReport

    names = {i: f"campaign shard {i}/{total}" for i in range(1, total + 1)}
    session.items = [
        CampaignShard.from_parent(session, name=name, nodeid=name, index=i, total=total) for i, name in names.items()
    ]
    config.hook.pytest_collectreport(
        report=CollectReport(session.nodeid, "passed", longrepr=None, result=list(session.items))
    )
    try:
        config.hook.pytest_collection_modifyitems(session=session, config=config, items=session.items)
    finally:
        config.hook.pytest_collection_finish(session=session)
    session.testscollected = len(session.items)
    return True


class CampaignMerge:
    """On the controller only: notes which shards ran, merges their reports at the session's end."""

    def __init__(self, config):
        self.config, self.ran, self.message = config, set(), ""

    def pytest_runtest_logreport(self, report):
        match = SHARD_NAME.match(report.nodeid)
        if match and report.when == "call":
            self.ran.add(int(match.group(1)))

    def pytest_sessionfinish(self, session):
        import shutil

        from harness.commands.merge_reports import merge_reports
        from harness.core.errors import HarnessError

        out = campaign_out(self.config)
        reports = [out / f"shard-{i}" for i in sorted(self.ran) if (out / f"shard-{i}" / "report.json").is_file()]
        if not reports:
            self.message = f"harness campaign: no shard wrote a report to merge (in {out})"
            return
        shutil.rmtree(out / "merged" / "heatmaps", ignore_errors=True)  # the previous merge's pictures
        try:
            payload = merge_reports(out / "merged", reports)
        except HarnessError as error:
            self.message = f"harness campaign: merging the shard reports failed: {error}"
            return
        new = sum(1 for f in payload["findings"] if not f["known_issue"])
        examples = f"{payload['examples']} examples, " if "examples" in payload else ""
        self.message = (
            f"harness campaign: merged {len(reports)} shard report(s): {examples}{len(payload['findings'])} "
            f"finding(s), {new} new -> {out / 'merged' / 'report.md'}"
        )

    def pytest_terminal_summary(self, terminalreporter):
        if self.message:
            terminalreporter.write_line(self.message)
