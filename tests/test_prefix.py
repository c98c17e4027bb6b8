"""Steps over a prefix of the sparse caches (docs/design.md, "Prefix lengths"): the host picks
the shortest length that holds every row's live slots, and the logits are those of the whole
cache (the float64 oracle's); compiled, one graph serves every length."""

import contextlib
from unittest import mock

import pytest
import torch

from helpers import needs, random_ids, random_model, run_oracle
from shram_static import accelerators, decoder as decoder_mod, state as state_mod
from shram_static.bench.cli import main as bench_main
from shram_static.decoder import StaticDecoder
from shram_static.state import MIN_PREFIX, prefix_len, prefix_lengths


@pytest.mark.parametrize("S,L,K", [(2048, 16, 4), (32768, 16, 4), (1024, 4, 2), (100, 8, 4)])
def test_prefix_lengths_and_the_length_a_step_takes(S, L, K):
    """Powers of two from MIN_PREFIX, then the whole cache (exports); multiples of a spacing,
    then T (compiled). The length picked is the shortest that holds ceil(count / W) slots,
    checked against a scan of every length."""
    model_cfg = random_model(1, num_mosrah_heads=L, num_selected_heads=K).config
    model_cfg.inference_sequence_length = S
    T, W = model_cfg.mosrah_cache_length, L // K
    powers = prefix_lengths(model_cfg)
    assert powers[-1] == T + 1 and all(p == MIN_PREFIX * 2 ** i for i, p in enumerate(powers[:-1]))
    assert all(2 * p <= T + 1 for p in powers[:-1])
    spaced = prefix_lengths(model_cfg, 64)
    assert spaced[-1] == T and list(spaced[:-1]) == list(range(64, T, 64))
    for lengths in (powers, spaced):
        for count in range(0, S + 1, max(1, S // 97)):
            need = -(-count // W)
            want = min([p for p in lengths if p >= need], default=lengths[-1])
            assert prefix_len(lengths, W, count) == want
            assert want >= need  # no live slot is ever past the whole cache


def _decoders(model, **kw):
    return StaticDecoder(model, batch_size=2, prefill_chunk=8, **kw)


def test_steps_at_every_depth_match_the_oracle_and_a_short_prefix_would_not(monkeypatch):
    """Two rows at different depths (one left-padded), prefill chunks, decode, verify and a
    rollback: the logits equal the float64 oracle's at every step while the length grows
    through several prefixes; attending one length shorter than picked moves them (the check
    can fail)."""
    model = random_model(3, num_mosrah_heads=8, num_selected_heads=2, training_sequence_length=64,
                         inference_sequence_length=64)  # T = 20: lengths 4, 8, 12, 16, 20
    cfg = model.config
    ids = random_ids(cfg, 2, 56, 5)
    mask = torch.ones(2, 56, dtype=torch.bool)
    mask[1, :19] = False  # row 1 is 19 tokens behind
    ref = run_oracle(model, ids, mask)[0].float()  # (2, 56, V)
    used = []
    pick = state_mod.prefix_len
    monkeypatch.setattr(state_mod, "prefix_len", lambda *a: used.append(pick(*a)) or used[-1])
    dec = _decoders(model, verify_len=3)
    assert dec.prefix_lengths == (4, 8, 12, 16, 20)
    lg = dec.prefill(ids[:, :20], mask[:, :20])
    torch.testing.assert_close(lg[0], ref[0, :20], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lg[1, 19:], ref[1, 19:20], atol=2e-4, rtol=2e-4)
    for i in range(20, 40):
        torch.testing.assert_close(dec.decode(ids[:, i]), ref[:, i], atol=2e-4, rtol=2e-4)
    v = dec.verify(ids[:, 40:43])
    torch.testing.assert_close(v, ref[:, 40:43], atol=2e-4, rtol=2e-4)
    dec.rollback(2)
    for i in range(41, 56):
        torch.testing.assert_close(dec.decode(ids[:, i]), ref[:, i], atol=2e-4, rtol=2e-4)
    assert {4, 8, 12, 16} <= set(used)
    # one length short of the pick at the last steps: some live slots unread, other logits
    short = _decoders(model)
    short.prefill(ids[:, :48], mask[:, :48])
    monkeypatch.setattr(state_mod, "prefix_len", lambda lengths, *a: lengths[lengths.index(pick(lengths, *a)) - 1])
    assert not torch.allclose(short.decode(ids[:, 48]), ref[:, 48], atol=2e-4, rtol=2e-4)


@pytest.mark.heavy
@needs("dynamic_prefix")
def test_compiled_steps_are_one_graph_for_every_length(monkeypatch):
    """A compiled decode step whose rows cross several prefix lengths: one graph per side of
    ACC_CHUNK (the length is a dynamic size; here the sides split at 12 slots, not 4096), both
    compiled by `warm_up`, no recompile, the eager decoder's logits. (Every kind of step is one
    function of the same code: the prefill step runs eager here, one cold compile fewer.)"""
    torch._dynamo.reset()
    monkeypatch.setattr(decoder_mod, "ACC_CHUNK", 12)
    model = random_model(4, num_mosrah_heads=4, num_selected_heads=2, num_decoder_layers=1,
                         training_sequence_length=48, inference_sequence_length=48)  # T = 26: lengths 4 .. 24, 26
    ids = random_ids(model.config, 2, 46, 6)
    eager = _decoders(model)
    comp = _decoders(model, compile=("decode",))
    counters = torch._dynamo.utils.counters["stats"]
    # the accelerators off after the build change nothing: a decoder keeps what it was built with
    stack = contextlib.ExitStack()
    stack.enter_context(accelerators.stock())
    comp.warm_up(("decode", "prefill"))
    graphs = counters["unique_graphs"]
    with stack, torch.compiler.set_stance("fail_on_recompile"):
        torch.testing.assert_close(comp.prefill(ids[:, :16]), eager.prefill(ids[:, :16]), atol=2e-4, rtol=2e-4)
        for i in range(16, 46):
            torch.testing.assert_close(comp.decode(ids[:, i]), eager.decode(ids[:, i]), atol=2e-4, rtol=2e-4)
    assert counters["unique_graphs"] == graphs  # warm_up compiled both; the steps compiled nothing
    assert sorted(comp._steps) == [("decode", False), ("decode", True), ("prefill", False), ("prefill", True)]
    assert graphs >= 2


def test_warm_up_changes_no_state_and_bad_kinds_are_refused():
    """`warm_up` runs dead tokens: the next steps give a fresh decoder's logits. An unknown kind
    of step, or a verify warm-up without a verify step, is a ValueError."""
    model = random_model(5, training_sequence_length=32)
    ids = random_ids(model.config, 2, 12, 7)
    fresh, warmed = _decoders(model), _decoders(model)
    warmed.prefill(ids[:, :5])
    warmed.reset()
    warmed.warm_up(("decode", "prefill", "prefill_last", "verify"))
    torch.testing.assert_close(warmed.prefill(ids[:, :9]), fresh.prefill(ids[:, :9]), atol=0, rtol=0)
    torch.testing.assert_close(warmed.decode(ids[:, 9]), fresh.decode(ids[:, 9]), atol=0, rtol=0)
    with accelerators.stock():  # the dynamic length off: compiled steps read the whole cache
        assert StaticDecoder(model, compile=True).prefix_lengths == (model.config.mosrah_cache_length,)
    # several lengths where the accelerator is on (SHRAM_STATIC_STOCK off)
    assert (len(StaticDecoder(model, compile=True).prefix_lengths) > 1) == accelerators.enabled("dynamic_prefix")
    with pytest.raises(ValueError, match="kinds"):
        fresh.step_function("decoder")
    with pytest.raises(ValueError, match="compile must be"):
        StaticDecoder(model, compile=("decode", "everything"))
    with pytest.raises(ValueError, match="verify_len"):
        StaticDecoder(model, verify_len=None).warm_up(("verify",))
    with pytest.raises(ValueError, match="kinds are"), mock.patch.object(fresh, "_run") as run:
        fresh.warm_up(("decode", "decoder"))  # refused before any step runs
    run.assert_not_called()


def test_bench_refuses_depths_past_the_capacity(capsys):
    with pytest.raises(ValueError, match="at most 991"):
        bench_main(["--models", "builtin", "--capacity", "1024", "--depths", "64", "1000", "--steps", "32"])
