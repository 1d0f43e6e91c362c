"""Errors the CLI turns into one line and exit status 2 (never a traceback)."""


class HarnessError(Exception):
    """A problem with the user's input or environment, reported as one line."""


class CheckpointError(HarnessError):
    """A checkpoint that cannot be read or does not follow its declared format."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
