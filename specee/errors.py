"""One exception type for user-facing errors: run.py prints its message, not a traceback."""


class SpeceeError(RuntimeError):
    """Bad input or configuration; the message says what to change."""
