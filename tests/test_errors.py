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


def test_an_error_met_while_compiling_says_which():
    # vllm[enforce_eager=false] on a ct FP8-channel checkpoint with static input scales (the
    # campaign, session 28): torch.compile wraps the known narrow() failure in its own words
    text = (
        "RuntimeError when making fake tensor call\n"
        "  Explanation: Dynamo failed to run FX node with fake tensors: call_function <built-in method narrow of "
        "type object at 0x7fa9428cea40>(*(Parameter(FakeTensor(..., size=())), 0, 0, s72), **{}): "
        "got RuntimeError('narrow() cannot be applied to a 0-dim tensor.')\n"
        "  Hint: Your code may result in an error when running in eager."
    )
    assert first_line(text) == (
        "RuntimeError when making fake tensor call: RuntimeError: narrow() cannot be applied to a 0-dim tensor."
    )
