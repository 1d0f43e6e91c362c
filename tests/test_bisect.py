"""`bisect`: version listing, the search with skips, usage errors, and end to end on a local
package with a planted regression (tests/doubles/planted_loader.py): no network."""

from __future__ import annotations

import pytest

from harness.core.errors import HarnessError
from harness.lanes.bisect import (
    BAD,
    GOOD,
    SKIP,
    CheckRun,
    PipSource,
    bisect_versions,
    released_versions,
    versions_between,
)
from tests.cli import run_cli
from tests.doubles import planted_loader


def cli(*args, timeout=1800):
    return run_cli(*args, timeout=timeout)


@pytest.fixture
def wheels(tmp_path):
    directory = tmp_path / "wheels"
    planted_loader.write_wheels(directory)
    (directory / "planted_loader-1.5.0rc1-py3-none-any.whl").write_bytes(b"")  # listed, never installed
    (directory / "other_package-9.0-py3-none-any.whl").write_bytes(b"")
    (directory / "notes.txt").write_text("not a distribution")
    return directory


def test_versions_from_a_find_links_directory(wheels):
    source = PipSource(find_links=[str(wheels)])
    assert "--no-index" in source.options()
    listed = released_versions("planted-loader", source)
    assert listed == ["1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0rc1", "1.5.0", "1.6.0"]
    assert versions_between(listed, "1.0.0", "1.6.0") == [v for v in listed if v != "1.5.0rc1"]
    assert "1.5.0rc1" in versions_between(listed, "1.0.0", "1.6.0", pre=True)
    assert versions_between(listed, "1.6.0", "1.3.0") == ["1.6.0", "1.5.0", "1.4.0", "1.3.0"]


@pytest.mark.parametrize(
    "good, bad, problem",
    [
        ("1.0.0", "1.0.0", "same version"),
        ("0.9.0", "1.6.0", "0.9.0 is not released"),
        ("1.0.0", "banana", "not a PEP 440 version"),
    ],
)
def test_bad_version_ranges(good, bad, problem):
    with pytest.raises(HarnessError, match=problem):
        versions_between(["1.0.0", "1.6.0"], good, bad)


def fake(results: dict[str, int]):
    tested = []

    def test(version):
        tested.append(version)
        return CheckRun(version, results[version], f"check of {version}")

    return test, tested


VERSIONS = [f"1.{i}.0" for i in range(7)]


def outcomes(first_bad: str, skips=()) -> dict[str, int]:
    return {v: SKIP if v in skips else (BAD if v >= first_bad else GOOD) for v in VERSIONS}


@pytest.mark.parametrize("first_bad", VERSIONS[1:])
def test_binary_search_finds_every_first_bad(first_bad):
    test, tested = fake(outcomes(first_bad))
    result = bisect_versions(VERSIONS, test)
    assert result.first_bad == first_bad and result.last_good == VERSIONS[VERSIONS.index(first_bad) - 1]
    assert len(tested) <= 2 + 3  # both ends, then log2 of the 5 between


def test_skipped_versions_are_stepped_around():
    test, tested = fake(outcomes("1.5.0", skips={"1.3.0"}))
    result = bisect_versions(VERSIONS, test)
    assert (result.first_bad, result.last_good) == ("1.5.0", "1.4.0")
    assert tested[:3] == ["1.0.0", "1.6.0", "1.3.0"] and tested[3] == "1.2.0"


def test_a_skip_next_to_the_first_bad_is_ambiguous():
    test, _ = fake(outcomes("1.4.0", skips={"1.3.0"}))
    result = bisect_versions(VERSIONS, test)
    assert result.first_bad is None and result.candidates == ["1.3.0", "1.4.0"]
    assert "one of 1.3.0, 1.4.0" in result.message


def test_only_skips_left_names_the_candidates():
    test, _ = fake(outcomes("1.4.0", skips={"1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0"}))
    result = bisect_versions(VERSIONS, test)
    assert result.first_bad is None
    assert result.candidates == ["1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0", "1.6.0"]


@pytest.mark.parametrize(
    "results, problem",
    [
        ({**outcomes("1.0.0")}, "the good version 1.0.0 is bad"),
        ({**outcomes("1.4.0"), "1.6.0": GOOD}, "the bad version 1.6.0 is good"),
        ({**outcomes("1.4.0"), "1.0.0": SKIP}, "the good version 1.0.0 cannot be tested"),
    ],
)
def test_inconsistent_ends(results, problem):
    test, tested = fake(results)
    result = bisect_versions(VERSIONS, test)
    assert result.first_bad is None and problem in result.message


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--case", "no-such-case", "--package", "x", "--good", "1", "--bad", "2"], "no such case"),
        (
            [
                "--case",
                "transformers-fp8-block-aligned-agrees",
                "--package",
                "x",
                "--good",
                "1",
                "--bad",
                "2",
                "--engine",
                "nope",
            ],
            "unknown engine",
        ),
        (
            [
                "--case",
                "transformers-fp8-block-aligned-agrees",
                "--package",
                "planted_loader",
                "--good",
                "0.1",
                "--bad",
                "1.6.0",
                "--find-links",
                "WHEELS",
            ],
            "0.1 is not released",
        ),
        (["--package", "x"], "required"),
    ],
)
def test_usage_errors_exit_2_in_one_line(wheels, args, problem):
    result = cli("bisect", *[str(wheels) if a == "WHEELS" else a for a in args], timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert problem in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.needs_engine("transformers")
@pytest.mark.parametrize(
    ("good", "bad", "built"),
    [
        # CI: the two ends only (the search itself is unit-tested above), a venv per version
        ("1.3.0", "1.4.0", ["1.3.0", "1.4.0"]),
        pytest.param("1.0.0", "1.6.0", ["1.0.0", "1.3.0", "1.4.0", "1.6.0"], marks=pytest.mark.nightly),
    ],
)
def test_bisect_finds_the_planted_regression(wheels, tmp_path, good, bad, built):
    """Seven wheels, the regression planted in 1.4.0: venvs are built from the local wheels only
    (--find-links implies --no-index), the engine's worker runs under each venv's python."""
    case = tmp_path / "planted.toml"
    case.write_text(planted_loader.CASE)
    cache = tmp_path / "cache"
    result = cli(
        "bisect",
        "--case",
        case,
        "--package",
        "planted_loader",
        "--good",
        good,
        "--bad",
        bad,
        "--find-links",
        wheels,
        "--cache",
        cache,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "first bad version of planted_loader: 1.4.0 (last good: 1.3.0)" in output
    assert "--- last good: planted_loader 1.3.0 (check exit 0) ---" in output
    assert "--- first bad: planted_loader 1.4.0 (check exit 1) ---" in output
    assert "engine planted_loader.engine:PlantedEngine 1.4.0 (" + str(cache / "planted-loader-1.4.0") in output
    made = sorted(p.name for p in cache.iterdir() if p.is_dir())
    assert made == [f"planted-loader-{version}" for version in built]
