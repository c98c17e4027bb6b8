"""Inductor's CPU ISA checks run in parallel, and a compiled decoder waits for them before its
first compile (shram_static/cpu_isa.py)."""

import functools
import platform
import sys
import threading

import pytest
import torch
from torch._inductor import cpu_vec_isa

import shram_static.decoder as decoder_mod
from helpers import random_config, randomize_
from shram_static import ShramForCausalLM, StaticDecoder, cpu_isa
from shram_static.cpu_isa import start_isa_checks


class FakeIsa:
    """Stands for one of Inductor's ISA objects: its check passes only if every fake's check is
    running at the same time (a barrier), so one-after-another checking times out."""

    def __init__(self, name, barrier, seen):
        self.name, self.barrier, self.seen = name, barrier, seen

    def __str__(self):
        return self.name

    def __bool__(self):
        self.barrier.wait(timeout=10)
        self.seen.append((self.name, threading.current_thread().name))
        return True


@pytest.fixture
def fake_isas(monkeypatch):
    """Three fake ISAs the CPU 'has' and one it lacks, with Inductor undecided."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        pytest.skip("Inductor checks ISAs this way on x86-64 Linux and Windows only")
    seen = []
    barrier = threading.Barrier(3)
    isas = [FakeIsa(n, barrier, seen) for n in ("avx512 amx_tile", "avx512", "avx2", "neon")]
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", isas)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx512", "amx_tile", "avx2"])
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", functools.cache(lambda: []))
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(cpu_isa, "_started", None)  # no checks started in this process yet
    return seen


def test_isa_checks_run_in_parallel_once_per_process(fake_isas):
    thread = start_isa_checks()
    assert start_isa_checks() is thread  # a second decoder waits on the same checks
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert sorted(n for n, _ in fake_isas) == ["avx2", "avx512", "avx512 amx_tile"]  # not "neon"
    assert len({t for _, t in fake_isas}) == 3  # one thread each
    assert start_isa_checks() is thread and len(fake_isas) == 3  # checked once


def test_isa_checks_skipped_when_inductor_needs_none(fake_isas, monkeypatch):
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", True)  # the user's override
    assert start_isa_checks() is None
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(cpu_isa, "_started", None)
    cpu_vec_isa.valid_vec_isa_list()  # decided already in this process
    assert start_isa_checks() is None
    assert fake_isas == []


def test_compiled_decoder_waits_for_the_checks_before_compiling(monkeypatch):
    events = []

    class Checks:
        def join(self):
            events.append("joined")

    monkeypatch.setattr(decoder_mod, "start_isa_checks", Checks)
    cfg = random_config(3, num_decoder_layers=1)
    model = randomize_(ShramForCausalLM(cfg), 3)
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=4, compile=True)
    eager = StaticDecoder(model, batch_size=1, prefill_chunk=4)
    # Stand-ins for the compiled steps (a real compile takes seconds): record the order.
    dec.prefill_step = lambda *a: events.append("compiled") or dec._prefill_step(*a)
    dec.decode_step = lambda *a: events.append("compiled") or dec._decode_step(*a)
    ids = torch.randint(0, cfg.vocab_size, (1, 4))
    torch.testing.assert_close(dec.prefill(ids), eager.prefill(ids))
    dec.decode(ids[:, 0])
    assert events == ["joined", "compiled", "compiled"]  # joined once, before the first step
    assert StaticDecoder(model, compile=False)._isa_checks is None
