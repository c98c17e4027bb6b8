"""Inductor's vector ISA is checked best-first in a background thread, and Inductor's decision
waits for it and picks what it would pick from its full list (shram_static/accelerators/cpu_isa.py)."""

import functools
import platform
import sys
import threading

import pytest
import torch
from torch._inductor import cpu_vec_isa

from helpers import random_config, randomize_
from shram_static import ShramForCausalLM, StaticDecoder
from shram_static.accelerators import cpu_isa, enabled
from shram_static.accelerators.cpu_isa import start_isa_checks

# Inductor's own list, uncached (taken at collection, before any test installs the checks).
INDUCTORS = cpu_vec_isa.valid_vec_isa_list.__wrapped__


class FakeIsa:
    """Stands for one of Inductor's ISA objects: its check returns `ok` once `gate` is set."""

    def __init__(self, name, ok, gate, seen, bit_width=512):
        self.name, self.ok, self.gate, self.seen, self.width = name, ok, gate, seen, bit_width

    def __str__(self):
        return self.name

    def bit_width(self):
        return self.width

    def __bool__(self):
        assert self.gate.wait(timeout=10)
        self.seen.append((self.name, threading.current_thread().name))
        if isinstance(self.ok, Exception):
            raise self.ok
        return self.ok


@pytest.fixture
def fakes(monkeypatch):
    """The CPU 'has' AMX (whose check fails here), AVX-512 and AVX2, and lacks NEON; Inductor
    undecided, with its own (cached) list function, as in a fresh process. Inductor's settings
    through its own `config.patch` (a monkeypatched config entry is lost on undo under pytest
    9.2, and every later compile in the process fails)."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        pytest.skip("Inductor checks ISAs this way on x86-64 Linux and Windows only")
    if not enabled("isa_check_ahead"):
        pytest.skip("the accelerator isa_check_ahead is off here (torch version or SHRAM_STATIC_STOCK)")
    seen, gate = [], threading.Event()
    isas = [FakeIsa("avx512 amx_tile", False, gate, seen), FakeIsa("avx512", True, gate, seen),
            FakeIsa("avx2", True, gate, seen, 256), FakeIsa("neon", True, gate, seen, 128)]
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", isas)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx512", "amx_tile", "avx2"])
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", functools.cache(INDUCTORS))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(cpu_isa, "_started", None)  # no checks started in this process yet
    with torch._inductor.config.patch({"cpp.vec_isa_ok": None, "cpp.simdlen": None}):
        yield isas, seen, gate


def _inductors_pick(isas):
    """What Inductor alone picks with the fakes' answers (its full list, fresh)."""
    gate = isas[0].gate
    gate.set()
    full = INDUCTORS()
    return full, cpu_vec_isa.get_isa_from_cpu_capability(None, full, cpu_vec_isa.invalid_vec_isa)


def test_check_stops_at_the_first_valid_isa_and_inductor_waits_for_it(fakes):
    isas, seen, gate = fakes
    thread = start_isa_checks()
    assert start_isa_checks() is thread  # a second decoder waits on the same check
    picked = []
    asker = threading.Thread(target=lambda: picked.append(cpu_vec_isa.pick_vec_isa()))
    asker.start()  # Inductor's first compile asks while the check still runs
    asker.join(timeout=0.3)
    assert asker.is_alive() and picked == []  # it waits for the check
    gate.set()
    asker.join(timeout=10)
    assert [str(p) for p in picked] == ["avx512"]
    assert [n for n, _ in seen] == ["avx512 amx_tile", "avx512"]  # not avx2: never used
    assert {t for _, t in seen} == {"shram-isa-checks"}  # in the background thread
    assert cpu_vec_isa.valid_vec_isa_list() == [isas[1]]
    seen.clear()
    full, pick = _inductors_pick(isas)
    assert [str(i) for i in full] == ["avx512", "avx2"] and pick is picked[0]  # Inductor's choice
    assert start_isa_checks() is thread and not thread.is_alive()


@pytest.mark.parametrize("setting", ["simdlen", "capability"])
@pytest.mark.parametrize("asked_before", [False, True])
def test_settings_that_use_the_full_list_get_inductors_list(fakes, monkeypatch, setting, asked_before):
    isas, seen, gate = fakes
    thread = start_isa_checks()
    gate.set()
    thread.join(timeout=10)
    if asked_before:  # a first compile without the setting
        assert str(cpu_vec_isa.pick_vec_isa()) == "avx512"
    # Set after the start (and after a first compile, or before any): the full list, checked
    # by Inductor itself, and its pick.
    simdlen = 256 if setting == "simdlen" else None
    if setting == "capability":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    with torch._inductor.config.patch({"cpp.simdlen": simdlen}):
        assert cpu_vec_isa.valid_vec_isa_list() == [isas[1], isas[2]]
        assert str(cpu_vec_isa.pick_vec_isa()) == "avx2"
        # The same setting before the start: nothing is started or replaced.
        monkeypatch.setattr(cpu_isa, "_started", None)
        monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", functools.cache(INDUCTORS))
        assert start_isa_checks() is None
        assert cpu_vec_isa.valid_vec_isa_list.__wrapped__ is INDUCTORS


def test_nothing_started_when_inductor_needs_no_check(fakes, monkeypatch):
    isas, seen, gate = fakes
    with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):  # the user's override
        assert start_isa_checks() is None
    gate.set()
    cpu_vec_isa.valid_vec_isa_list()  # decided already in this process
    seen.clear()
    assert start_isa_checks() is None
    assert seen == [] and cpu_vec_isa.valid_vec_isa_list.__wrapped__ is INDUCTORS


def test_a_failing_check_is_left_to_inductor(fakes):
    isas, seen, gate = fakes
    isas[0].ok = RuntimeError("probe crashed")
    start_isa_checks()
    gate.set()
    with pytest.raises(RuntimeError, match="probe crashed"):  # as Inductor's own check raises
        cpu_vec_isa.valid_vec_isa_list()
    assert [n for n, t in seen] == ["avx512 amx_tile", "avx512 amx_tile"]  # thread, then Inductor


def test_compiled_decoder_on_cpu_starts_the_check(monkeypatch):
    started = []
    monkeypatch.setattr(cpu_isa, "start_isa_checks", lambda: started.append(1))
    cfg = random_config(3, num_decoder_layers=1)
    model = randomize_(ShramForCausalLM(cfg), 3)
    StaticDecoder(model, batch_size=1, prefill_chunk=4)
    assert started == []  # eager: nothing compiles
    StaticDecoder(model, batch_size=1, prefill_chunk=4, compile=True)
    assert started == [1]  # at construction, before any step is called
