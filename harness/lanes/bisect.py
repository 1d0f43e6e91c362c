"""`python -m harness bisect`: the first released version of a package in which a check goes bad.

Lists the released versions between --good and --bad (from the package index through
`pip index versions`, or from --find-links directories), builds one cached virtual
environment per version, runs `python -m harness check CASE` there and binary-searches.
Exit 0: the first bad version was found (printed with the check's output for the last good
and the first bad); 1: not found (the good version is bad, the bad one good, or only
untestable versions are left); 2: usage error. A check that exits 125 skips its version, as
`git bisect run` does.

Each environment is a venv that inherits the launching interpreter's site-packages through a
.pth file placed in its own site-packages. The venv's own site-packages comes first on
sys.path, so the pinned version (and any dependency pip had to change for it) shadows the
inherited one, while torch and the rest are reused instead of downloaded again; pip leaves the
inherited packages alone (they lie outside the environment). The reference engine keeps
running under the launching interpreter (HARNESS_REFERENCE_PYTHON), so the oracle does not
change while the engine under test does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.paths import PROJECT_ROOT

EXIT_FOUND, EXIT_NOT_FOUND, EXIT_USAGE = 0, 1, 2
GOOD, BAD, SKIP = 0, 1, 125
ROOT = PROJECT_ROOT
DEFAULT_CACHE = Path("~/.cache/quant-load-harness/bisect")
MARKER = "harness-bisect.json"


@dataclass
class PipSource:
    """Where versions come from: index URLs and/or find-links locations."""

    index_url: str | None = None
    extra_index_urls: list[str] = field(default_factory=list)
    find_links: list[str] = field(default_factory=list)

    def options(self) -> list[str]:
        options = []
        if self.index_url:
            options += ["--index-url", self.index_url]
        for url in self.extra_index_urls:
            options += ["--extra-index-url", url]
        for link in self.find_links:
            options += ["--find-links", link]
        if self.find_links and not self.index_url and not self.extra_index_urls:
            options.append("--no-index")  # --find-links alone: that directory is the only source
        return options


def _version(text: str):
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text)
    except InvalidVersion:
        raise HarnessError(f"'{text}' is not a PEP 440 version") from None


def versions_in_directory(directory: Path, package: str) -> list[str]:
    """Versions of `package` among the wheels and sdists in a find-links directory."""
    from packaging.utils import (
        InvalidSdistFilename,
        InvalidWheelFilename,
        canonicalize_name,
        parse_sdist_filename,
        parse_wheel_filename,
    )

    wanted, found = canonicalize_name(package), []
    for path in directory.iterdir():
        try:
            if path.name.endswith(".whl"):
                name, version, _, _ = parse_wheel_filename(path.name)
            elif path.name.endswith((".tar.gz", ".zip")):
                name, version = parse_sdist_filename(path.name)
            else:
                continue
        except (InvalidWheelFilename, InvalidSdistFilename):
            continue
        if name == wanted:
            found.append(str(version))
    return found


def versions_from_index(package: str, source: PipSource, pre: bool) -> list[str]:
    command = [sys.executable, "-m", "pip", "index", "versions", package, *source.options()]
    if pre:
        command.append("--pre")
    completed = subprocess.run(command, capture_output=True, text=True)
    match = re.search(r"^Available versions:\s*(.+)$", completed.stdout, re.MULTILINE)
    if completed.returncode != 0 or not match:
        why = (completed.stderr.strip().splitlines() or ["no versions listed"])[-1]
        raise HarnessError(f"cannot list versions of {package}: {why}")
    return [v.strip() for v in match.group(1).split(",") if v.strip()]


def released_versions(package: str, source: PipSource, pre: bool = False) -> list[str]:
    """Every released version, oldest first; local directories are read directly."""
    local = [Path(link) for link in source.find_links if "://" not in link or link.startswith("file://")]
    local = [Path(str(p).removeprefix("file://")) for p in local]
    if (
        source.find_links
        and len(local) == len(source.find_links)
        and not source.index_url
        and not source.extra_index_urls
    ):
        versions = []
        for directory in local:
            if not directory.is_dir():
                raise HarnessError(f"--find-links {directory}: not a directory")
            versions += versions_in_directory(directory, package)
    else:
        versions = versions_from_index(package, source, pre)
    unique = {}
    for text in versions:
        unique.setdefault(_version(text), text)
    return [unique[v] for v in sorted(unique)]


def versions_between(all_versions: list[str], good: str, bad: str, pre: bool = False) -> list[str]:
    """good, the releases strictly between (pre-releases only with `pre`), bad; oldest first."""
    good_v, bad_v = _version(good), _version(bad)
    if good_v == bad_v:
        raise HarnessError(f"--good and --bad are the same version {good}")
    by_version = {_version(v): v for v in all_versions}
    for given, parsed in ((good, good_v), (bad, bad_v)):
        if parsed not in by_version:
            nearby = ", ".join(all_versions[-8:]) or "none"
            raise HarnessError(f"version {given} is not released (latest listed: {nearby})")
    low, high = min(good_v, bad_v), max(good_v, bad_v)
    inner = [v for v in sorted(by_version) if low < v < high and (pre or not v.is_prerelease)]
    ordered = [by_version[low]] + [by_version[v] for v in inner] + [by_version[high]]
    return ordered if good_v < bad_v else ordered[::-1]


# ---------------------------------------------------------------- environments


def inherited_site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"]) if p and Path(p).is_dir()))


def harness_source_root() -> Path | None:
    """The harness's source tree when it is a checkout (installable with pip), else None."""
    return ROOT if (ROOT / "pyproject.toml").is_file() and (ROOT / "harness").is_dir() else None


def torch_constraint(directory: Path) -> Path | None:
    """Keep the inherited torch: pip must never resolve another (a multi-GB download)."""
    try:
        from importlib.metadata import version

        torch_version = version("torch").split("+")[0]
    except Exception:
        return None
    path = directory / "constraints.txt"
    path.write_text(f"torch=={torch_version}\n")
    return path


class EnvironmentBuilder:
    """One venv per version under `cache/NAME-VERSION`, reused when its marker matches."""

    def __init__(
        self, cache: Path, package: str, source: PipSource, requirements: list[str], rebuild: bool = False, log=print
    ):
        from packaging.utils import canonicalize_name

        self.cache = cache
        self.package = package
        self.name = canonicalize_name(package)
        self.source = source
        self.requirements = requirements
        self.rebuild = rebuild
        self.log = log

    def directory(self, version: str) -> Path:
        return self.cache / f"{self.name}-{version}"

    def python(self, directory: Path) -> Path:
        return directory / ("Scripts/python.exe" if os.name == "nt" else "bin/python")

    def identity(self, version: str) -> dict:
        return {
            "package": self.package,
            "version": version,
            "base_python": sys.executable,
            "inherits": inherited_site_packages(),
            "requirements": self.requirements,
            "harness": str(harness_source_root() or "inherited"),
            "sources": self.source.options(),
        }

    def ensure(self, version: str) -> tuple[Path | None, str]:
        """(the venv's python, what happened) or (None, why it could not be built)."""
        directory = self.directory(version)
        marker = directory / MARKER
        identity = self.identity(version)
        if not self.rebuild and marker.is_file() and self.python(directory).exists():
            try:
                if json.loads(marker.read_text()) == identity:
                    return self.python(directory), f"cached {directory}"
            except ValueError:
                pass
        shutil.rmtree(directory, ignore_errors=True)
        directory.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"  building {directory} ...")
        build_log = directory.parent / f"{directory.name}.build.log"
        with build_log.open("w") as log:
            ok, why = self._build(directory, version, log)
        if not ok:
            shutil.rmtree(directory, ignore_errors=True)
            return None, f"{why} (log: {build_log})"
        marker.write_text(json.dumps(identity, indent=2) + "\n")
        return self.python(directory), f"built {directory}"

    def _build(self, directory: Path, version: str, log) -> tuple[bool, str]:
        def step(command: list[str], what: str) -> bool:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode == 0

        if not step([sys.executable, "-m", "venv", "--without-pip", str(directory)], "venv"):
            return False, "cannot create the venv"
        python = self.python(directory)
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if not purelib:
            return False, "the new venv's python does not run"
        lines = [f"import site; site.addsitedir({path!r})" for path in inherited_site_packages()]
        (Path(purelib) / "_harness_bisect_inherit.pth").write_text("\n".join(lines) + "\n")
        pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--disable-pip-version-check"]
        source = harness_source_root()
        if source is not None and not step(pip + ["--no-deps", "--no-build-isolation", "-e", str(source)], "harness"):
            return False, "cannot install the harness (--no-deps) into the venv"
        constraint = torch_constraint(directory)
        command = pip + self.source.options() + (["-c", str(constraint)] if constraint else [])
        command += [f"{self.package}=={version}", *self.requirements]
        if not step(command, "package"):
            return False, f"pip cannot install {self.package}=={version}"
        probe = subprocess.run(
            [
                str(python),
                "-c",
                f"import sys; from importlib.metadata import version; print(version({self.package!r}))",
            ],
            capture_output=True,
            text=True,
        )
        got = probe.stdout.strip()
        if _version(got or "0") != _version(version):
            return False, f"{self.package} {got or '?'} is what the venv imports, not {version}"
        return True, ""


# ---------------------------------------------------------------- checks and search


@dataclass
class CheckRun:
    version: str
    code: int
    output: str


def check_environment(engine: str | None, python: Path) -> dict[str, str]:
    """The check's environment: the engine's worker under the bisect venv, the reference under
    the launching interpreter, nothing fetched."""
    from harness.engines.environments import variable_for

    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault(variable_for("reference"), sys.executable)
    if engine and engine != "reference":
        env[variable_for(engine)] = str(python)
    return env


def check_in_release(python: Path, case: str, engine: str | None, extra: list[str], version: str) -> CheckRun:
    command = [str(python), "-m", "harness", "check", case, *(["--engine", engine] if engine else []), *extra]
    completed = subprocess.run(command, capture_output=True, text=True, env=check_environment(engine, python))
    output = (completed.stdout + completed.stderr).strip()
    code = completed.returncode if completed.returncode in (GOOD, BAD, SKIP) else SKIP
    if code != completed.returncode:
        output += f"\n(check exited {completed.returncode}: counted as cannot test)"
    return CheckRun(version, code, output)


@dataclass
class BisectResult:
    first_bad: str | None
    last_good: str | None
    runs: dict[str, CheckRun]
    message: str
    candidates: list[str] = field(default_factory=list)


def bisect_versions(versions: list[str], test) -> BisectResult:
    """`versions`: good first, bad last. `test(version) -> CheckRun`. Binary search for the
    first bad one; a 125 skips its version (the next untested one nearest the middle is tried)."""
    runs: dict[str, CheckRun] = {}

    def run(version: str) -> CheckRun:
        if version not in runs:
            runs[version] = test(version)
        return runs[version]

    good, bad = versions[0], versions[-1]
    first = run(good)
    if first.code != GOOD:
        what = "is bad" if first.code == BAD else "cannot be tested"
        return BisectResult(None, None, runs, f"the good version {good} {what}: nothing to bisect")
    last = run(bad)
    if last.code != BAD:
        what = "is good" if last.code == GOOD else "cannot be tested"
        return BisectResult(None, good, runs, f"the bad version {bad} {what}: nothing to bisect")
    low, high = 0, len(versions) - 1
    while high - low > 1:
        middle = (low + high) // 2
        order = sorted(range(low + 1, high), key=lambda i: (abs(i - middle), i))
        for index in order:
            if runs.get(versions[index]) and runs[versions[index]].code == SKIP:
                continue
            code = run(versions[index]).code
            if code == GOOD:
                low = index
                break
            if code == BAD:
                high = index
                break
        else:
            candidates = versions[low + 1 : high + 1]
            return BisectResult(
                None,
                versions[low],
                runs,
                f"only untestable versions are left: the first bad version is one of {', '.join(candidates)}",
                candidates,
            )
    return BisectResult(versions[high], versions[low], runs, f"first bad version: {versions[high]}")
