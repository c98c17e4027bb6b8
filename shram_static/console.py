"""Progress and status lines of the commands: to stderr, flushed, so stdout stays the result."""

import sys


def info(msg: str) -> None:
    """Prints one status line to stderr (flushed at once)."""
    print(msg, file=sys.stderr, flush=True)
