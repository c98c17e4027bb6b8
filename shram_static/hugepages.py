"""Huge pages under the memory a decode step streams (Linux 6.1 and newer).

A decode step reads every weight once: ~250 MB on the bench model, ~60k pages of 4 KiB, each a
TLB miss and, on a virtual machine, a two-dimensional page walk. The same weights on 2 MiB pages
made the bench model's decode step 0.79-0.99x the time on every backend (docs/performance.md,
"Huge pages"). Where the kernel's transparent huge
pages are `madvise` (the common default), memory gets huge pages only where it was advised, and
none of torch's, XNNPACK's or onnxruntime's allocators advises it.

`MADV_COLLAPSE` (Linux 6.1) rewrites memory that is already populated onto huge pages, in place
and synchronously, whatever the THP setting: values, addresses and layouts stay as they were.
`collapse_resident` applies it to every 2 MiB-aligned range of the process's private anonymous
memory whose 512 pages are all resident, so no page is added (a range with a hole is left as it
is and the process's RSS does not grow). The decoders call it once they hold their weights;
`SHRAM_STATIC_STOCK=huge_pages` turns it off. Elsewhere (another OS, an older kernel) it does
nothing.
"""

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
import time

from . import accelerators

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes in one huge page (x86-64 and arm64 with 4 KiB base pages)
PAGE = mmap.PAGESIZE
MADV_COLLAPSE = 25  # linux/mman.h


@functools.cache
def _libc():
    """libc with errno, or None where there is no madvise/mincore to call (not Linux)."""
    if not sys.platform.startswith("linux") or PAGE != 4096:
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def anonymous_regions(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) of each private, writable, anonymous mapping of this process (the heap
    included; files, stacks and special mappings left out)."""
    out = []
    with open(maps) as f:
        for line in f:
            parts = line.split()
            perms = parts[1]
            path = parts[5] if len(parts) > 5 else ""
            if perms.startswith("rw") and perms[3] == "p" and path in ("", "[heap]"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b))
    return out


def _resident_runs(libc, start: int, end: int):
    """Runs (lo, hi) of whole 2 MiB-aligned ranges within [start, end) whose pages are all
    resident."""
    lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    if hi <= lo:
        return
    vec = ctypes.create_string_buffer((hi - lo) // PAGE)
    if libc.mincore(lo, hi - lo, vec) != 0:
        return
    per, raw = HUGE // PAGE, vec.raw  # one byte per page, bit 0 set where resident
    run = None
    for i in range((hi - lo) // HUGE):
        full = b"\x00" not in raw[i * per:(i + 1) * per]
        at = lo + i * HUGE
        if full:
            run = (run[0], at + HUGE) if run else (at, at + HUGE)
        elif run:
            yield run
            run = None
    if run:
        yield run


@functools.cache
def supported() -> bool:
    """Whether `MADV_COLLAPSE` works here: tried once on a populated 4 MiB anonymous mapping of
    its own (Linux 6.1 and newer, transparent huge pages not "never")."""
    libc = _libc()
    if libc is None:
        return False
    with mmap.mmap(-1, 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:  # not shared memory
        m.write(b"\x01" * (2 * HUGE))  # populate every page
        buf = ctypes.c_char.from_buffer(m)
        try:
            addr = ctypes.addressof(buf)
            lo = -(-addr // HUGE) * HUGE  # the aligned 2 MiB range inside the 4 MiB
            ok = libc.madvise(lo, HUGE, MADV_COLLAPSE) == 0
            if not ok:
                log.debug("MADV_COLLAPSE unavailable (%s): memory stays on 4 KiB pages",
                          os.strerror(ctypes.get_errno()))
        finally:
            del buf
    return ok


def _active() -> bool:
    """Turned on (`SHRAM_STATIC_STOCK`) and `MADV_COLLAPSE` available."""
    return accelerators.enabled("huge_pages") and supported()


def collapse_resident(regions: list[tuple[int, int]] | None = None) -> int:
    """Moves the fully resident 2 MiB ranges of `regions` (default: all of
    `anonymous_regions()`) onto huge pages with `MADV_COLLAPSE`. Best effort: a range the kernel
    refuses (no free huge page now, memory locked) stays on small pages.

    Args:
        regions: (start, end) address ranges of this process's private anonymous memory.

    Returns:
        The bytes moved onto huge pages (0 where turned off, not Linux, or before Linux 6.1).
    """
    if not _active():
        return 0
    libc, t, done = _libc(), time.perf_counter(), 0
    for start, end in anonymous_regions() if regions is None else regions:
        for lo, hi in _resident_runs(libc, start, end):
            if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
                done += hi - lo
    log.debug("moved %.0f MiB onto huge pages in %.2f s", done / 2**20, time.perf_counter() - t)
    return done


def collapse_tensors(tensors) -> int:
    """`collapse_resident` over the storages of `tensors` (each counted once) that lie in
    anonymous memory (a tensor over a mapped file is left alone).

    Args:
        tensors: torch tensors; those not on the CPU or under 2 MiB are skipped.

    Returns:
        The bytes moved onto huge pages.
    """
    if not _active():  # before reading the process's mappings
        return 0
    anon = anonymous_regions()
    seen, regions = set(), []
    for t in tensors:
        s = t.untyped_storage()
        a = s.data_ptr()
        if s.device.type != "cpu" or s.nbytes() < HUGE or a in seen:
            continue
        seen.add(a)
        if any(lo <= a and a + s.nbytes() <= hi for lo, hi in anon):
            regions.append((a, a + s.nbytes()))
    return collapse_resident(regions) if regions else 0
