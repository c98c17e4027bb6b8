"""Huge pages under the decoders' weights (`shram_static.hugepages`): a populated range moves
onto 2 MiB pages with its values and address unchanged, a range with holes is left alone (no
page added), the switch keeps small pages, and each decoder collapses what its steps read."""

import ctypes
import mmap

import pytest
import torch

from helpers import random_model
from shram_static import StaticDecoder, hugepages
from shram_static.accelerators import STOCK_ENV
from shram_static.fast_layers import RowExperts, RowLinear

needs_collapse = pytest.mark.skipif(not hugepages.supported(), reason="no MADV_COLLAPSE here (Linux 6.1+)")


def anon_huge_kib(addr: int | None = None) -> int:
    """AnonHugePages of the mapping holding `addr` (the whole process: None), in KiB."""
    with open("/proc/self/smaps" if addr is not None else "/proc/self/smaps_rollup") as f:
        inside = addr is None
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = addr is None or lo <= addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError("no such mapping")


def resident_pages(addr: int, size: int) -> int:
    vec = ctypes.create_string_buffer(size // mmap.PAGESIZE)
    assert hugepages._libc().mincore(addr, size, vec) == 0
    return sum(b & 1 for b in vec.raw)


@needs_collapse
def test_a_tensor_moves_onto_huge_pages_with_its_values_and_address():
    """A tensor over fresh private anonymous memory (small pages: nothing advised it) moves
    onto huge pages, its values and address as they were."""
    size = 8 * hugepages.HUGE
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        x = torch.frombuffer(m, dtype=torch.float32)
        x.copy_(torch.randn(x.numel(), generator=torch.Generator().manual_seed(0)))
        want, ptr = x.clone(), x.data_ptr()
        before = anon_huge_kib(ptr)
        moved = hugepages.collapse_tensors([x, x[1:]])  # one storage, counted once
        assert 7 * hugepages.HUGE <= moved <= size  # its 2 MiB-aligned interior
        if "[always]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
            assert anon_huge_kib(ptr) - before == moved // 1024
        assert x.data_ptr() == ptr and torch.equal(x, want)
        del x


@needs_collapse
def test_a_range_with_holes_gets_no_page():
    """Of four 2 MiB ranges, the two whose every page was written move onto huge pages; the two
    with untouched pages stay as they were, no page added."""
    size = 5 * hugepages.HUGE
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        buf = ctypes.c_char.from_buffer(m)
        try:
            addr = ctypes.addressof(buf)
            lo = -(-addr // hugepages.HUGE) * hugepages.HUGE  # four aligned ranges from here
            off = lo - addr
            for i in range(4):
                start = off + i * hugepages.HUGE
                n = hugepages.HUGE if i in (0, 2) else hugepages.HUGE // 2  # 1 and 3: half written
                m[start:start + n] = b"\x07" * n
            pages = resident_pages(lo, 4 * hugepages.HUGE)
            moved = hugepages.collapse_resident([(addr, addr + size)])
            assert moved == 2 * hugepages.HUGE
            assert resident_pages(lo, 4 * hugepages.HUGE) == pages
            assert m[off:off + 4] == b"\x07" * 4 and m[off + 2 * hugepages.HUGE - 1] == 0  # range 1: unwritten
        finally:
            del buf


@needs_collapse
def test_stock_switch_keeps_small_pages(monkeypatch):
    monkeypatch.setenv(STOCK_ENV, "huge_pages")
    x = torch.randn(2**22)
    before = anon_huge_kib()
    assert hugepages.collapse_tensors([x]) == 0 and hugepages.collapse_resident() == 0
    assert anon_huge_kib() - before < 2048  # nothing of ours collapsed


def test_a_tensor_over_a_file_is_left_alone(tmp_path):
    path = tmp_path / "w.bin"
    torch.randn(2**22).numpy().tofile(path)
    x = torch.from_file(str(path), shared=False, size=2**22)  # a private map of the file
    assert hugepages.collapse_tensors([x]) == 0


def test_compiled_decoder_collapses_its_packed_copies_and_state_only(monkeypatch):
    """A compiled decoder hands `collapse_tensors` what its steps stream, its packed copies
    and its state, and never the caller's weights; an eager decoder hands it nothing."""
    import shram_static.decoder as D

    calls = []
    monkeypatch.setattr(D, "collapse_tensors", lambda ts: calls.append(list(ts)) or 0)
    model = random_model(3)
    StaticDecoder(model)
    assert calls == []
    dec = StaticDecoder(model, compile=True)  # compiles at its first step, not here
    assert len(calls) == 1
    got = {t.data_ptr() for t in calls[0]}
    packed = {b.data_ptr() for m in dec.module.modules() if isinstance(m, (RowLinear, RowExperts))
              for b in m.buffers(recurse=False)}
    assert packed and packed <= got
    assert {t.data_ptr() for t in dec.state.tensors()} <= got
    assert not got & {p.data_ptr() for p in model.parameters()}
