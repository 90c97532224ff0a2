"""The one exception type users see: a message that says what went wrong and what to do."""


class TierlmError(Exception):
    """A user-facing error. The CLI prints `str(err)` as one line and exits non-zero."""

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)
