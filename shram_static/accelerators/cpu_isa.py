"""Inductor's choice of vector ISA, checked best-first in a background thread.

WHY: Inductor's `valid_vec_isa_list` builds and loads a probe program for every ISA the CPU reports,
in turn, before its first C++ kernel, and `pick_vec_isa` takes the first valid one: with a cold
cache many g++ runs, most for ISAs never used. `start_isa_checks` checks them in Inductor's order
(`bool(isa)`) in a background thread while Dynamo traces, stopping at the first valid one; Inductor
then waits for it and gets the ISA it would pick from its full list.
"""

import os
import platform
import sys
import threading

from .registry import enabled


def _candidates() -> list | None:
    """The ISA objects Inductor would check here, best first (x86-64 Linux and Windows); None where it
    has decided, would not check, would use more than the first valid ISA, or its internals differ."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        return None
    try:
        from torch._inductor import config, cpu_vec_isa
        if (config.is_fbcode() or config.cpp.vec_isa_ok is not None or not _first_is_picked()
                or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize):  # currsize: decided in this process
            return None
        flags = cpu_vec_isa.x86_isa_checker()
        return [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(f in flags for f in str(isa).split())]
    except Exception:  # noqa: BLE001 (another torch: Inductor checks as usual)
        return None


def _first_is_picked() -> bool:
    """Whether `pick_vec_isa` takes the first valid entry: no `cpp.simdlen`, no `ATEN_CPU_CAPABILITY`."""
    from torch._inductor import config

    return config.cpp.simdlen is None and not os.environ.get("ATEN_CPU_CAPABILITY")


class _Checks:
    """The background check and the `valid_vec_isa_list` that waits for it."""

    def __init__(self, candidates: list, inductors):
        self.candidates, self.inductors = candidates, inductors
        self.chosen: list | None = None  # [the first valid ISA] or []; None if a check raised
        self.thread = threading.Thread(target=self._check, name="shram-isa-checks", daemon=True)

    def _check(self) -> None:
        try:
            self.chosen = next(([isa] for isa in self.candidates if isa), [])
        except Exception:  # noqa: BLE001 (Inductor's own list repeats the check and reports it)
            pass

    def valid_vec_isa_list(self) -> list:
        """Inductor's `valid_vec_isa_list` while installed: the chosen ISA alone, or Inductor's own where
        a check raised or a setting asks for another entry. Not cached: a setting changed later is seen."""
        self.thread.join()
        if self.chosen is None or not _first_is_picked():
            return self.inductors()
        return list(self.chosen)


_lock = threading.Lock()
_started: _Checks | None = None  # this process's checks, once started


def start_isa_checks() -> threading.Thread | None:
    """Starts the check of Inductor's vector ISA in a background thread, once per process.

    WHY private names: Inductor has no public way to check ahead of a compile, or only until its choice
    is known. This replaces `cpu_vec_isa.valid_vec_isa_list` (only caller: `pick_vec_isa`) with one
    that waits for the thread and returns the first valid ISA alone (see `_Checks`). Nothing else
    probes ISA objects meanwhile (`VecAVX512.__bool__` rewrites its flags while it checks).

    Returns:
        The daemon thread of the check (the same for every call in a process); None when there is
        nothing to check (the accelerator off, or the decision made).
    """
    global _started
    with _lock:
        if _started is None:
            if not enabled("isa_check_ahead") or (candidates := _candidates()) is None:
                return None
            from torch._inductor import cpu_vec_isa

            _started = _Checks(candidates, cpu_vec_isa.valid_vec_isa_list)
            cpu_vec_isa.valid_vec_isa_list = _started.valid_vec_isa_list
            _started.thread.start()
        return _started.thread
