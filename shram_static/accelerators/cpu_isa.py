"""Inductor's choice of vector ISA, checked best-first in a background thread.

Before it generates its first C++ kernel in a process, Inductor decides which vector ISA to
compile for (`cpu_vec_isa.pick_vec_isa`). Its `valid_vec_isa_list` builds and loads a probe
program for every ISA the CPU reports, one after the other, and `pick_vec_isa` then takes the
first valid one. On an AVX-512/AMX CPU that is about ten g++ runs and child Pythons with a cold
compile cache (a new user's first compile), most of them deciding ISAs that are never used
(docs/performance.md, "Accelerators").

`start_isa_checks` checks the candidates in Inductor's order in a background thread and stops
at the first valid one, through exactly the calls Inductor makes (`bool(isa)`, cached per ISA
object). Meanwhile Dynamo and AOTAutograd trace on the other core; when Inductor first asks
for the list, it waits for the thread and gets the chosen ISA: the ISA `pick_vec_isa` would
pick from the full list.

Registered as the accelerator `isa_check_ahead` (registry.py): with another
torch than it was verified on, or with `SHRAM_STATIC_STOCK=1`, nothing is started.
"""

import os
import platform
import sys
import threading

from .registry import enabled


def _candidates() -> list | None:
    """The ISA objects Inductor would check in this process, best first (x86-64 Linux and
    Windows), or None where it has already decided, where it would not check, or where it
    would use more of its list than the first valid ISA, or where its internals differ."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        return None
    try:
        from torch._inductor import config, cpu_vec_isa
        if config.is_fbcode() or config.cpp.vec_isa_ok is not None or not _first_is_picked():
            return None
        if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:  # decided in this process
            return None
        flags = cpu_vec_isa.x86_isa_checker()
        return [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(f in flags for f in str(isa).split())]
    except Exception:  # noqa: BLE001 (another torch: Inductor checks as usual)
        return None


def _first_is_picked() -> bool:
    """Whether `pick_vec_isa` takes the first entry of the valid list: no `cpp.simdlen` and no
    ISA named by `ATEN_CPU_CAPABILITY` (which may select a later entry)."""
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
        """What Inductor's `valid_vec_isa_list` is while the checks are installed: the chosen ISA
        alone where `pick_vec_isa` would take the first entry of the full list; else Inductor's
        own (cached) full list: a check raised, or a setting asks for another entry. Not cached
        itself, so a setting changed between two compiles is seen by the second."""
        self.thread.join()
        if self.chosen is None or not _first_is_picked():
            return self.inductors()
        return list(self.chosen)


_lock = threading.Lock()
_started: _Checks | None = None  # this process's checks, once started


def start_isa_checks() -> threading.Thread | None:
    """Starts the check of Inductor's vector ISA in a background thread, once per process.

    WHY private Inductor names: Inductor offers no public way to check ahead of a compile, or
    to check only until its choice is known. This replaces `cpu_vec_isa.valid_vec_isa_list`,
    whose only caller is `pick_vec_isa`, with a function that waits for the thread and
    returns the first valid ISA alone (what `pick_vec_isa` takes from the full list when neither
    `cpp.simdlen` nor `ATEN_CPU_CAPABILITY` is set; otherwise Inductor's own function runs).
    Nothing compiles before the wait, and nothing else probes ISA objects while the thread
    does (an ISA object probed by two threads at once could see the other's temporary compiler
    flags: `VecAVX512.__bool__` rewrites its `_arch_flags` while it checks bf16). Where the
    accelerator `isa_check_ahead` is off, with a setting that needs the full list, or with a
    decision already made, it does nothing.

    Returns:
        The daemon thread running (or done with) the check: the same thread for every call in
        a process; None when there is nothing to check.
    """
    global _started
    with _lock:
        if _started is None:
            if not enabled("isa_check_ahead"):
                return None
            candidates = _candidates()
            if candidates is None:
                return None
            from torch._inductor import cpu_vec_isa

            _started = _Checks(candidates, cpu_vec_isa.valid_vec_isa_list)
            cpu_vec_isa.valid_vec_isa_list = _started.valid_vec_isa_list
            _started.thread.start()
        return _started.thread
