"""Error lines keep what the user needs, however long the paths in them are."""

from harness.core.errors import CheckpointError, first_line


def test_a_deep_path_does_not_cut_off_the_diagnosis():
    """The CI failure of session 2: a 300-character cap cut the convention's name off a long-path error."""
    path = "/tmp/" + "/".join(["a-rather-long-directory-name"] * 12) + "/model.safetensors"
    error = CheckpointError(path, "weight_global_scale is 7.5e-05 < 1: this looks like a ModelOpt multiplier")
    line = first_line(f"{error}\nTraceback (most recent call last): ...")
    assert line.endswith("this looks like a ModelOpt multiplier")
    assert "\n" not in line


def test_a_bare_announcement_takes_its_next_line():
    assert first_line("ValueError:\n  the block grid is 3x4, expected 4x3\n more") == (
        "ValueError: the block grid is 3x4, expected 4x3"
    )


def test_a_runaway_message_is_bounded():
    assert len(first_line("x" * 10**6)) < 10**4


def test_a_validation_error_shows_its_innermost_cause():
    """vLLM wraps its refusals in pydantic: the line must say what was refused, not only where."""
    text = (
        "ValidationError: 1 validation error for VllmConfig\n"
        "  Value error, weight_block_size must be a list of two integers, got [128] "
        "[type=value_error, input_value=ArgsKwargs((), {...}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.12/v/value_error"
    )
    assert first_line(text) == (
        "ValidationError: 1 validation error for VllmConfig: weight_block_size must be a list of two integers, "
        "got [128]"
    )
