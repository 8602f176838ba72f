"""Errors that reach the user as one clear line and a non-zero exit, never as a traceback."""


class ShardstackError(Exception):
    """A problem the user can fix (bad input, missing tool, wrong state). `exit_code` is what the CLI returns."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg}\n  hint: {self.hint}" if self.hint else msg
