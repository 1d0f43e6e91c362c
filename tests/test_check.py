"""`check`: case files, the verdict rules, and the exit codes git bisect reads (0 good, 1 bad,
125 cannot test), on real transformers cases with tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.core.findings import Finding
from harness.differential.known_issues import KnownIssues
from harness.differential.runner import CheckpointResult, EngineOutcome
from harness.lanes.check import (
    CHECKS_DIR,
    EXIT_BAD,
    EXIT_CANNOT_TEST,
    EXIT_GOOD,
    CannotTest,
    CheckCase,
    judge_case,
    load_case,
    load_case_file,
)
from tests.cli import run_cli as cli

CASE_FILES = sorted(CHECKS_DIR.glob("*.toml"))


def write_case(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "case.toml"
    path.write_text(text)
    return path


RECIPE = '[recipe]\nformat = "fp8-block"\narch = "llama"\nconfig = { num_hidden_layers = 1 }\n'


# ---------------------------------------------------------------- case files


@pytest.mark.parametrize("path", CASE_FILES, ids=[p.stem for p in CASE_FILES])
def test_every_shipped_case_parses(path):
    case = load_case_file(path)
    assert case.engine == "transformers"
    if case.known_issue:  # the case names an existing known issue, with the same kind
        issue = KnownIssues.load().by_id(case.known_issue)
        assert set(case.kinds) <= set(issue.kinds)


def test_at_least_three_cases_check_known_issues():
    assert len([p for p in CASE_FILES if load_case_file(p).known_issue]) >= 3


@pytest.mark.parametrize(
    "text, problem",
    [
        ('engine = "transformers"\ncolour = "red"\n' + RECIPE, "unknown key"),
        ('engine = "transformers"\nexpect = "maybe"\n' + RECIPE, "expect"),
        ('engine = "transformers"\nexpect = "finding"\n' + RECIPE, "needs `kind`"),
        ('engine = "transformers"\nexpect = "finding"\nkind = "wrong-kind"\n' + RECIPE, "unknown finding kind"),
        ('engine = "transformers"\nkind = "load-error"\n' + RECIPE, "belong to expect"),
        ('engine = "transformers"\nknown_issue = "no-such-issue"\n' + RECIPE, "no known issue"),
        ('engine = "transformers"\n', "needs a [recipe]"),
        ('engine = "transformers"\n' + RECIPE + 'colour = "red"\n', "unknown recipe key"),
        ('engine = "transformers"\n' + RECIPE + 'set = ["block_size=64", "wobble=1"]\n', "unknown setting 'wobble'"),
        ('engine = "transformers"\n' + RECIPE.replace("fp8-block", "fp9"), "unknown format"),
        (RECIPE, "no engine"),
        ('engine = "transformers"\nthis is not toml', "not valid TOML"),
    ],
)
def test_bad_case_files_are_one_line_errors(tmp_path, text, problem):
    with pytest.raises(Exception) as raised:
        load_case(str(write_case(tmp_path, text)))
    assert problem in str(raised.value)
    assert "\n" not in str(raised.value)


def test_set_uses_the_gen_vocabulary(tmp_path):
    path = write_case(
        tmp_path,
        'engine = "transformers"\n[recipe]\nformat = "fp8-block"\narch = "qwen2"\n'
        'set = ["hidden_size=200", "block_size=64", "shards=1", "zero_block=true"]\n',
    )
    recipe = load_case_file(path).recipe
    assert recipe.config == {"hidden_size": 200} and recipe.knobs == {"block_size": 64}
    assert recipe.layout == {"shards": 1} and recipe.perturb == {"zero_block": True}


def test_case_by_bare_name_and_engine_override():
    case = load_case("transformers-fp8-block-aligned-agrees", engine="compressed-tensors")
    assert case.engine == "compressed-tensors" and case.expect == "agree"
    with pytest.raises(CannotTest, match="no such case"):
        load_case("no-such-case")


def test_reproduction_directory_needs_a_manifest(tmp_path):
    with pytest.raises(CannotTest, match="not a reproduction directory"):
        load_case(str(tmp_path), engine="transformers")


# ---------------------------------------------------------------- verdict rules


def result_with(engine_status="loaded", findings=(), reference_status="loaded", detail=""):
    result = CheckpointResult("ckpt", "fp8-block", "exact")
    result.outcomes["reference"] = EngineOutcome("reference", status=reference_status)
    result.outcomes["transformers"] = EngineOutcome("transformers", status=engine_status, detail=detail)
    result.findings = [Finding("transformers", "5.0", kind, "fp8-block", message) for kind, message in findings]
    return result


AGREE = CheckCase("c", "c", "transformers")
MISMATCH = CheckCase("c", "c", "transformers", expect="finding", kinds=["weight-mismatch"])
REFUSED = CheckCase("c", "c", "transformers", expect="finding", kinds=["load-error"], message="divisible by scale")
#: a known issue's reproducer (`check ID`): its loaders' findings with stand-in kernels decide, where no kernel runs
REPLAYED = CheckCase(
    "c", "c", "transformers", expect="finding", kinds=["weight-mismatch"], message="^with stand-in", replays_issue=True
)


@pytest.mark.parametrize(
    "case, result, code",
    [
        (AGREE, result_with(), EXIT_GOOD),
        (AGREE, result_with(findings=[("weight-mismatch", "x")]), EXIT_BAD),
        (AGREE, result_with("failed", [("load-error", "boom")]), EXIT_BAD),
        (AGREE, result_with("unavailable"), EXIT_CANNOT_TEST),
        (AGREE, result_with("unsupported"), EXIT_CANNOT_TEST),
        (AGREE, result_with(reference_status="failed"), EXIT_CANNOT_TEST),
        (AGREE, result_with(detail="partly unsupported: no kernel"), EXIT_CANNOT_TEST),
        (MISMATCH, result_with(findings=[("weight-mismatch", "x"), ("logprobs", "y")]), EXIT_BAD),
        (MISMATCH, result_with(), EXIT_GOOD),
        # another bug (a refusal) is not this one: the silent mismatch is absent
        (MISMATCH, result_with("failed", [("load-error", "must be divisible by block sizes")]), EXIT_GOOD),
        (MISMATCH, result_with("failed", [("engine-crash", "exited with status 139")]), EXIT_CANNOT_TEST),
        (
            REFUSED,
            result_with("failed", [("load-error", "Weight shape (200, 160) not divisible by scale grid")]),
            EXIT_BAD,
        ),
        (REFUSED, result_with("failed", [("load-error", "must be divisible by block sizes")]), EXIT_GOOD),
        (REPLAYED, result_with("unsupported", [("weight-mismatch", "with stand-in kernels: q_proj")]), EXIT_BAD),
        # the engine ran no kernel: a finding of the kind that is not the issue's cannot say it is absent
        (REPLAYED, result_with("unsupported", [("weight-mismatch", "k_proj differs")]), EXIT_CANNOT_TEST),
        (
            MISMATCH,
            result_with("unsupported", [("weight-mismatch", "with stand-in kernels: q_proj")]),
            EXIT_CANNOT_TEST,
        ),
    ],
)
def test_judge(case, result, code):
    assert judge_case(case, result).code == code


def test_known_issues_do_not_excuse(tmp_path):
    result = result_with(findings=[("weight-mismatch", "x")])
    result.findings[0].known_issue = "transformers-fp8-block-grid-inferred-from-shape"
    assert judge_case(AGREE, result).code == EXIT_BAD


# ---------------------------------------------------------------- the CLI: exit codes


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["no-such-case"],
        ["transformers-fp8-block-aligned-agrees", "--engine", "nope"],
        ["transformers-fp8-block-aligned-agrees", "--bogus"],
    ],
)
def test_user_errors_exit_125_in_one_line(args):
    result = cli("check", *args, timeout=120)
    assert result.returncode == EXIT_CANNOT_TEST, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_engine_without_the_format_cannot_test():
    result = cli("check", "transformers-fp8-block-aligned-agrees", "--engine", "compressed-tensors", timeout=300)
    assert result.returncode == EXIT_CANNOT_TEST, result.stdout + result.stderr
    assert "does not support fp8-block" in result.stdout


@pytest.mark.slow
@pytest.mark.needs_engine("transformers")
def test_reproduction_directory_good(tmp_path):
    """A directory as `run --report` leaves it in repro/, the engine taken from report.json. (A format
    transformers runs exactly on CPU, activations included: FineGrainedFP8's are not quantized there.)"""
    report = tmp_path / "report"
    directory = report / "repro" / "transformers-weight-mismatch-ct-fp8-channel"
    made = cli(
        "gen",
        "--format",
        "ct-fp8-channel",
        "--arch",
        "llama",
        "--out",
        directory,
        "--set",
        "num_hidden_layers=1",
        "--set",
        "intermediate_size=256",
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    (report / "report.json").write_text(
        json.dumps(
            {"findings": [{"engine": "transformers", "kind": "weight-mismatch", "reproduction": str(directory)}]}
        )
    )
    result = cli("check", directory)
    assert result.returncode == EXIT_GOOD, result.stdout + result.stderr
    assert "verdict: good" in result.stdout


@pytest.mark.slow
@pytest.mark.needs_engine("transformers")
def test_known_issue_case_is_bad():
    result = cli("check", CHECKS_DIR / "transformers-fp8-block-grid-inferred-from-shape.toml")
    assert result.returncode == EXIT_BAD, result.stdout + result.stderr
    assert "not excused here" in result.stdout and "verdict: bad" in result.stdout


def test_a_known_issue_id_is_a_case_of_its_reproducer():
    """`check ID`: the reproducer as a recipe, its engine with its options, its kinds and message,
    the relation its message names checked (the advice `upstream` gives where it writes no script)."""
    case = load_case("transformers-auto-round-forced-dtype-round-trip-moves-rotary-frequencies")
    issue = KnownIssues.load().by_id(case.name)
    assert (case.engine, case.expect, case.kinds, case.message) == (
        "transformers",
        "finding",
        ["relation"],
        issue.message,
    )
    assert case.relations == ("round-trip",) and case.replays_issue and case.recipe.format == "awq"
    # a case file of the same name comes first: cases/checks/ pins this one for bisects
    assert load_case("transformers-fp8-block-grid-inferred-from-shape").source.endswith(".toml")
    assert load_case("transformers-fp8-cpu-dequantized-model-in-another-dtype-cannot-run").engine == (
        "transformers[dtype=float16]"
    )


@pytest.mark.slow
@pytest.mark.needs_engine("vllm")
def test_a_known_issue_seen_through_stand_in_kernels_is_bad_where_the_engine_has_no_kernel():
    """vLLM has no WNA16 MoE kernel on CPU (the format is `unsupported`), yet its loaders, run with
    stand-in kernels, misplace Llama-4's asymmetric q/k zero points: the check says bad, not 125."""
    result = cli("check", "vllm-llama4-ct-int-asym-qk-zero-points-not-permuted-for-rotary", timeout=600)
    assert result.returncode == EXIT_BAD, result.stdout + result.stderr
    assert "with stand-in kernels" in result.stdout and "verdict: bad" in result.stdout


@pytest.mark.slow
@pytest.mark.needs_engine("transformers")
def test_a_known_issue_id_checks_good_on_an_engine_without_the_bug():
    result = cli("check", "vllm-qwen2-ignores-head-dim", "--engine", "reference", timeout=300)
    assert result.returncode == EXIT_GOOD, result.stdout + result.stderr
    assert "known issue vllm-qwen2-ignores-head-dim (cases/known_issues.toml)" in result.stdout
