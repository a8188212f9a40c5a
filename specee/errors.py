"""One exception type for user-facing errors: run.py prints its message, not a traceback."""


class SpeceeError(RuntimeError):
    """Bad input or configuration; the message says what to change."""


def one_line(err) -> str:
    """The message as one line: `specee: error: ...` is read (and grepped) line by line."""
    return " ".join(line.strip() for line in str(err).strip().splitlines())
