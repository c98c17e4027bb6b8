"""Independent export jobs (one per method or graph) in forked processes, one per CPU. WHY: lowering
is single-threaded Python, and a program's methods are lowered independently until emitted together.
A forked child starts with the parent's memory (the model, the patches of the enclosing `with`
blocks) and sends back its result as bytes.
"""

import os
import pickle
import sys
import tempfile
import traceback
import warnings
from typing import Callable

import torch

from .registry import enabled


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def can_fork() -> bool:
    """True where jobs can run in forked children: Linux, with at least two usable CPUs.
    WHY Linux only: macOS's system frameworks are not fork-safe, and Windows has no fork."""
    return sys.platform.startswith("linux") and usable_cpus() >= 2


def _child(job: Callable, encode: Callable, out_path: str) -> None:
    """In the forked child: the job's encoded result, or its traceback, into `out_path`."""
    # WHY one thread: GNU OpenMP's thread pool does not survive a fork (a parallel region in the
    # child would wait on the parent's workers), and the parent keeps the other core busy.
    torch.set_num_threads(1)
    try:
        payload = (True, encode(job()))
    except Exception:  # noqa: BLE001 (reported to the parent, which runs the job again)
        payload = (False, traceback.format_exc())
    with open(out_path, "wb") as f:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)


def run_jobs(jobs: dict, encode: Callable, decode: Callable, parallel: bool = True) -> dict:
    """Runs `jobs`: with `parallel` and `can_fork()`, the first here and the next ones, one per other
    usable CPU, in forked children, each result pickled through a file as `encode(result)` and
    `decode`d here. A failed child (an exception, a crash, the OOM killer) is reported with a
    warning and its job run again here.

    Args:
        jobs: name -> zero-argument callable; none may depend on another's side effects.
        encode: result -> a picklable value, run in the child; one with an `accelerator` attribute
            (private internals) is used only where that accelerator is on, else the jobs run here.
        decode: that value -> result, run here.
        parallel: False runs every job here, one after another (half the peak memory).

    Returns:
        name -> result, in the order of `jobs`.
    """
    names = list(jobs)
    accelerator = getattr(encode, "accelerator", None)  # an encoder that relies on private internals
    if not parallel or len(names) < 2 or not can_fork() or (accelerator and not enabled(accelerator)):
        return {n: jobs[n]() for n in names}
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    slots = max(1, usable_cpus() - 1)  # children beside this process
    results = {}
    with tempfile.TemporaryDirectory(prefix="shram_jobs_") as tmp:
        children = {}
        try:
            for i, n in enumerate(names[1:1 + slots]):
                out = os.path.join(tmp, f"{i}.pkl")
                sys.stdout.flush()  # else the child inherits, and prints again, what is buffered
                sys.stderr.flush()
                p = ctx.Process(target=_child, args=(jobs[n], encode, out), daemon=True)
                p.start()
                children[n] = (p, out)
            for n in names:
                if n not in children:
                    results[n] = jobs[n]()
            for n, (p, out) in children.items():
                p.join()
                results[n] = _collect(n, jobs[n], p.exitcode, out, decode)
        finally:
            for p, _ in children.values():  # on an exception here: stop the children
                if p.exitcode is None:
                    p.kill()
                    p.join()
    return {n: results[n] for n in names}


def _collect(name: str, job: Callable, exitcode: int, out: str, decode: Callable):
    """The child's decoded result, or the job run here after a warning saying why."""
    try:
        with open(out, "rb") as f:
            ok, payload = pickle.load(f)
        if ok:
            return decode(payload)
        why = payload.strip().splitlines()[-1]
    except (OSError, EOFError, pickle.UnpicklingError):
        why = f"it died: {'signal ' + str(-exitcode) if exitcode < 0 else 'exit code ' + str(exitcode)}"
    warnings.warn(f"the parallel process for {name!r} failed ({why}); running it in this process",
                  RuntimeWarning, stacklevel=3)
    return job()
