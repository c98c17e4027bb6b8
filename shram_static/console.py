"""What the commands share: argparse types, and progress and status lines (to stderr, flushed,
so stdout stays the result)."""

import argparse
import contextlib
import functools
import logging
import sys
import warnings


def positive_int(text: str) -> int:
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def info(msg: str) -> None:
    """Prints one status line to stderr (flushed at once)."""
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR):
    """Within the block, the named loggers drop records below `level` (restored afterwards).

    Args:
        names: logger names, e.g. "torchao".
        level: the lowest level still emitted.
    """
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, saved):
            lg.setLevel(lv)


@contextlib.contextmanager
def quiet_warnings(category: type[Warning], message: str):
    """Within the block, warnings of `category` whose text starts with the regex `message` are hidden."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=category)
        yield


# WHY dropped around exports: torch 2.13's `run_decompositions` deep-copies pytree `LeafSpec`s, which
# trips typing_extensions' deprecation shim: a FutureWarning about torch's code no caller can act on.
LEAFSPEC_NOTICE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


# The start of ExecuTorch's emitter warning for a mutated buffer whose initial bytes it does not store
MUTABLE_BUFFER_NOTICE = "Mutation on a buffer in the model is detected"

# WHY hidden: a `.pte`'s state is initialised by its first method and shared, so the notice misleads
without_mutable_buffer_notice = functools.partial(quiet_warnings, UserWarning, MUTABLE_BUFFER_NOTICE)
# torch's LeafSpec FutureWarning, hidden around both exporters' lowering
without_leafspec_notice = functools.partial(quiet_warnings, FutureWarning, LEAFSPEC_NOTICE)
