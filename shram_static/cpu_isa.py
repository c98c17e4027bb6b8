"""Inductor's check of this CPU's vector ISAs, run in parallel before the first compile.

Before it generates its first C++ kernel in a process, Inductor decides which vector ISA to
compile for by building a small probe program once per ISA that the CPU reports (AMX,
AVX-512 VNNI, AVX-512 with its bf16 variant, AVX2 on a recent x86 machine) and loading each in
a child Python. It does so one ISA after the other: 20.6 s on this 2-core machine with a cold
compile cache (a new user's first compile; each probe compiles ATen's vector headers), and
4.4 s with a warm one (the loads alone), in every process that compiles. The checks are
independent of each other, so `start_isa_checks` runs each one in its own thread (the work is
in g++ and child processes, so threads overlap): 13.0 s cold on 2 cores. Inductor then finds
every answer cached (`functools.cache` on each ISA object) and checks nothing itself.
"""

import platform
import sys
import threading
from concurrent.futures import ThreadPoolExecutor


def _unchecked_isas() -> list:
    """The ISA objects Inductor would check in this process (x86-64 Linux and Windows), or []
    where it has already decided, where it checks nothing, or where its internals differ."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        return []
    try:
        from torch._inductor import config, cpu_vec_isa
        if config.is_fbcode() or config.cpp.vec_isa_ok is not None:
            return []
        if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:  # decided in this process
            return []
        flags = cpu_vec_isa.x86_isa_checker()
        return [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(f in flags for f in str(isa).split())]
    except Exception:  # noqa: BLE001 (another torch: Inductor checks as usual)
        return []


_lock = threading.Lock()
_started: threading.Thread | None = None  # this process's checks, once started


def start_isa_checks() -> threading.Thread | None:
    """Starts Inductor's ISA checks in background threads, one per ISA, once per process.

    WHY private Inductor names: Inductor offers no public way to run its checks ahead of a
    compile or in parallel. This calls exactly what `cpu_vec_isa.valid_vec_isa_list` calls
    (`bool(isa)` on each candidate, which builds and loads the probe) and keeps no result of its
    own; with any other torch it does nothing and Inductor checks as usual.

    The caller must `join()` the thread before anything compiles: an ISA object that Inductor
    and a check thread both probe at once could see the other's temporary compiler flags
    (`VecAVX512.__bool__` rewrites its `_arch_flags` while it checks bf16).

    Returns:
        The daemon thread running (or done with) the checks: the same thread for every call in
        a process, so two decoders never probe one ISA object at once; None when there is
        nothing to check.
    """
    global _started
    with _lock:
        if _started is None:
            _started = _start(_unchecked_isas())
        return _started


def _start(isas: list) -> threading.Thread | None:
    """A started daemon thread checking `isas` in a pool of one thread each; None if none."""
    if not isas:
        return None

    def check_all():
        try:
            with ThreadPoolExecutor(len(isas), thread_name_prefix="shram-isa") as pool:
                list(pool.map(bool, isas))
        except Exception:  # noqa: BLE001 (Inductor repeats the failed check and reports it)
            pass

    thread = threading.Thread(target=check_all, name="shram-isa-checks", daemon=True)
    thread.start()
    return thread
