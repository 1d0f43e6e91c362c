"""Errors the CLI turns into one line and exit status 2 (never a traceback)."""

import re


class HarnessError(Exception):
    """A problem with the user's input or environment, reported as one line."""


class FormatError(ValueError):
    """A module's tensors do not follow the format (wrong shape, dtype, non-finite scale)."""


class Unsupported(HarnessError):
    """Valid input that the harness does not know (a quantization scheme, a layout): the CLI says
    `unsupported: <what>` in one line and exits 2, never a finding and never a silent pass."""


class UnsupportedFormat(Unsupported, FormatError):
    """A quantization_config that is valid for its producer but no registered format defines."""


class UnknownFormat(HarnessError, FormatError):
    """A format name no registry lists (harness.formats.require_formats says so, once for everyone)."""


class CheckpointError(HarnessError):
    """A checkpoint that cannot be read or does not follow its declared format."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedCheckpoint(CheckpointError, Unsupported):
    """A checkpoint in a scheme or layout the harness does not know (UnsupportedFormat, by file)."""


ERROR_LINE_LIMIT = 2000  # bounds a runaway message, never a real one: paths alone can take 300 characters


#: pydantic's announcement ("1 validation error for VllmConfig"); its cause is on a later line, "... [type=...]"
VALIDATION_ERROR = re.compile(r"\d+ validation errors? for \S+$")


#: what torch.compile's "Dynamo failed to run FX node ..." explanation says the traced call raised
TRACED_ERROR = re.compile(r"Dynamo failed to run FX node .*?: got (\w+)\((['\"])(.*?)\2\)", re.DOTALL)


def first_line(text) -> str:
    """The gist of an error: its first line, and the next one too when the first only announces it;
    for a pydantic validation error, its innermost cause (what vLLM's config refused, and why); for
    an error torch.compile met while tracing, the error it met ("RuntimeError when making fake tensor
    call" says nothing of which)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    traced = TRACED_ERROR.search(str(text))
    if lines and traced:
        return f"{lines[0]}: {traced.group(1)}: {traced.group(3)}"[:ERROR_LINE_LIMIT]
    if lines and VALIDATION_ERROR.search(lines[0]):
        cause = next((line for line in lines[1:] if " [type=" in line), None)
        if cause:
            cause = cause.partition(" [type=")[0].removeprefix("Value error, ")
            return f"{lines[0]}: {cause}"[:ERROR_LINE_LIMIT]
    if len(lines) > 1 and (lines[0].endswith(":") or len(lines[0]) < 24):
        return f"{lines[0]} {lines[1]}"[:ERROR_LINE_LIMIT]
    return lines[0][:ERROR_LINE_LIMIT] if lines else ""
