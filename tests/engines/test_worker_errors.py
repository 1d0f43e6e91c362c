"""What a worker says of an error: its type and message, and for one raised without a message (a
bare `assert` in an engine's loader) the function and source line that raised it, so that a finding
names the check that failed (harness.engines.worker.error_text)."""

from __future__ import annotations

from harness.engines.worker import error_text


def load_merged_column_weight(held, loaded):
    if held != loaded:  # a bare `assert` as vLLM writes it (pytest would rewrite one here with a message)
        raise AssertionError


def test_a_bare_assertion_names_the_check_that_failed():
    try:
        load_merged_column_weight([1, 32], [2, 32])
    except AssertionError as error:
        text = error_text(error)
    assert text.startswith("AssertionError: raised without a message in load_merged_column_weight (")
    assert text.endswith("): raise AssertionError") and "test_worker_errors.py:" in text


def test_an_error_with_a_message_is_its_type_and_message():
    try:
        raise ValueError("group_size 7 does not divide 160")
    except ValueError as error:
        assert error_text(error) == "ValueError: group_size 7 does not divide 160"
    assert error_text(RuntimeError()) == "RuntimeError: "  # never raised: no frame to name
