"""Exact rollback: after any mix of prefill, decode, verify and rollback calls, every logit a
decoder returned equals the uncached forward's over the tokens it kept (random configs, per-row
rollbacks across routing blocks and ring wrap-around); a rolled-back decoder continues like a
fresh one fed only the kept tokens; over-limit calls raise and change nothing; the compiled
verify step never recompiles."""

import unittest.mock

import pytest
import torch
from torch._inductor.graph import GraphLowering

from helpers import random_config, randomize_, run_oracle
from shram_static import ShramForCausalLM, StaticDecoder

TOL = 1e-3


class Recorder:
    """Feeds a decoder and keeps, per row, the kept tokens and the logits of each position's
    latest feeding (a position fed again after a rollback replaces the old entry)."""

    def __init__(self, dec):
        self.dec = dec
        self.seqs = [[] for _ in range(dec.batch_size)]
        self.logits = [{} for _ in range(dec.batch_size)]

    def _record(self, ids, live, logits):
        for b in range(ids.shape[0]):
            for j in torch.nonzero(live[b]).flatten().tolist():
                self.logits[b][len(self.seqs[b])] = logits[b, j]
                self.seqs[b].append(int(ids[b, j]))

    def prefill(self, ids, live):
        self._record(ids, live, self.dec.prefill(ids, live))

    def decode(self, ids, live):
        self._record(ids[:, None], live[:, None], self.dec.decode(ids, live)[:, None])

    def verify(self, ids, live):
        self._record(ids, live, self.dec.verify(ids, live))

    def rollback(self, n):
        self.dec.rollback(n)
        for b, k in enumerate(torch.as_tensor(n).expand(self.dec.batch_size).tolist()):
            del self.seqs[b][len(self.seqs[b]) - k:]

    def check(self, model):
        """Every recorded logit of a kept position against the uncached forward."""
        for b, seq in enumerate(self.seqs):
            want = model(torch.tensor([seq])).logits[0]
            got = torch.stack([self.logits[b][p] for p in range(len(seq))])
            err = (got - want).abs().max().item()
            assert err < TOL, f"row {b}: max logit error {err}"


def random_ops(rec: Recorder, gen: torch.Generator, n_ops: int) -> None:
    dec = rec.dec
    B, V, C = dec.batch_size, dec.config.vocab_size, dec.prefill_chunk
    rand = lambda hi: int(torch.randint(0, hi, (1,), generator=gen))
    for _ in range(n_ops):
        room = dec.capacity - int(dec.live_counts.max())
        op = rand(4)
        if op == 3 or room < 2 * C + 1:  # per-row rollback of up to what each row can forget
            can = dec.rollbackable
            rec.rollback(torch.stack([torch.randint(0, int(c) + 1, (1,), generator=gen)[0] for c in can]))
        elif op == 0:
            n = 1 + rand(2 * C + 1)
            live = torch.rand(B, n, generator=gen) > 0.15
            rec.prefill(torch.randint(0, V, (B, n), generator=gen), live)
        elif op == 1:
            rec.decode(torch.randint(0, V, (B,), generator=gen), torch.rand(B, generator=gen) > 0.2)
        else:
            n = 2 + rand(dec.verify_len - 1)
            rec.verify(torch.randint(0, V, (B, n), generator=gen), torch.rand(B, n, generator=gen) > 0.1)


@pytest.mark.parametrize("seed", range(4))
def test_random_rollback_is_exact(seed):
    """Random configs (W in 1..4, both rope modes), random chunk / verify / rollback limits, 40
    random calls on 2 rows: enough tokens to wrap the ring and cross many routing blocks."""
    gen = torch.Generator().manual_seed(seed)
    cfg = random_config(100 + seed, window_size=2 + seed % 3, training_sequence_length=64,
                        inference_sequence_length=64)
    model = randomize_(ShramForCausalLM(cfg), seed).eval()
    C = 2 + seed % 3
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=C, verify_len=3 + seed % 2,
                        rollback_limit=[None, C + 3][seed % 2])
    rec = Recorder(dec)
    random_ops(rec, gen, 40)
    assert max(len(s) for s in rec.seqs) > dec.state.ring + 2 * cfg.block_length  # wrapped the ring
    with torch.no_grad():
        rec.check(model)
        # Continues exactly like a fresh decoder fed only the kept tokens.
        fresh = StaticDecoder(model, batch_size=2, prefill_chunk=C)
        n = max(len(s) for s in rec.seqs)
        ids = torch.tensor([s + [0] * (n - len(s)) for s in rec.seqs])
        live = torch.tensor([[j < len(s) for j in range(n)] for s in rec.seqs])
        fresh.prefill(ids, live)
        assert torch.equal(fresh.live_counts, dec.live_counts)
        tok = torch.randint(0, cfg.vocab_size, (2,), generator=gen)
        torch.testing.assert_close(dec.decode(tok), fresh.decode(tok), atol=1e-4, rtol=1e-4)


def test_rollback_against_the_oracle():
    """Tokens fed, rolled back across a block boundary and the ring, replaced by others: the
    logits of the kept sequence equal the float64 reference's (tests/oracle.py)."""
    cfg = random_config(7, num_mosrah_heads=6, num_selected_heads=2, window_size=3, num_decoder_layers=1,
                        training_sequence_length=32, inference_sequence_length=32)
    model = randomize_(ShramForCausalLM(cfg), 7).eval()
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=4, verify_len=4)  # W = 3, ring 6
    rec = Recorder(dec)
    gen = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
    one = lambda n: torch.ones(1, n, dtype=torch.bool)
    rec.prefill(ids(7), one(7))
    rec.rollback(4)  # back into the previous routing block
    rec.verify(ids(4), one(4))
    rec.rollback(3)
    for _ in range(3):
        rec.decode(ids(1)[0], one(1)[0])
    rec.rollback(torch.tensor([2]))
    rec.verify(ids(3), one(3))
    want, _ = run_oracle(model, torch.tensor([rec.seqs[0]]))
    got = torch.stack([rec.logits[0][p] for p in range(len(rec.seqs[0]))])
    assert (got.double() - want[0]).abs().max().item() < TOL


def test_rollback_limit_and_bad_calls_leave_state():
    cfg = random_config(5, training_sequence_length=48, inference_sequence_length=48)
    model = randomize_(ShramForCausalLM(cfg), 5).eval()
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=3, verify_len=None, rollback_limit=4)
    assert dec.rollback_limit == 4 and dec.state.ring == cfg.window_size + 3
    dec.prefill(torch.randint(0, cfg.vocab_size, (2, 10)), torch.tensor([[1] * 10, [0] * 8 + [1] * 2]))
    assert dec.rollbackable.tolist() == [4, 2]  # row 1 holds 2 tokens
    snap = [t.clone() for t in dec.state.tensors()], dec.live_counts
    bad = [(5, ValueError, "row 0"), (3, ValueError, "row 1: it holds 2"), (-1, ValueError, ">= 0"),
           (torch.tensor([1, 1, 1]), ValueError, "shape"), (1.0, TypeError, "int"),
           (torch.tensor([0.5, 1.0]), TypeError, "integers"), (True, TypeError, "int")]
    for n, exc, words in bad:
        with pytest.raises(exc, match=words):
            dec.rollback(n)
        assert all(torch.equal(a, b) for a, b in zip(snap[0], dec.state.tensors()))
        assert torch.equal(dec.live_counts, snap[1])
    dec.rollback(torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="at most 1 now"):  # the ring keeps no more than 4 back
        dec.rollback(torch.tensor([2, 0]))
    snap = [t.clone() for t in dec.state.tensors()], dec.live_counts
    for active in (torch.ones(2, dtype=torch.bool), torch.ones(3, 1, dtype=torch.bool)):  # not (B, n)
        with pytest.raises(ValueError, match="active|shape"):
            dec.verify(torch.zeros(2, 1, dtype=torch.long), active)
        assert all(torch.equal(a, b) for a, b in zip(snap[0], dec.state.tensors()))
        assert torch.equal(dec.live_counts, snap[1])
    for bad in (True, 0):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            StaticDecoder(model, batch_size=bad)
    assert dec.live_counts.tolist() == [7, 0]
    dec.rollback(torch.tensor([1, 0]))
    dec.reset()
    assert dec.rollbackable.tolist() == [0, 0]


@pytest.mark.heavy
def test_compiled_verify_step_never_recompiles():
    """The verify step compiled (fullgraph, no dynamic shapes): after one warm-up call, verify,
    rollback and decode at fresh positions under fail_on_recompile equal eager."""
    torch._dynamo.reset()
    cfg = random_config(9, num_mosrah_heads=8, num_selected_heads=2, window_size=3, num_decoder_layers=1,
                        training_sequence_length=64)
    model = randomize_(ShramForCausalLM(cfg), 9).eval()
    kw = dict(batch_size=2, prefill_chunk=4, verify_len=3)
    eager = StaticDecoder(model, **kw)
    comp = StaticDecoder(model, compile=("verify",), **kw)  # only verify compiles
    gen = torch.Generator().manual_seed(9)
    ids = lambda n: torch.randint(0, cfg.vocab_size, (2, n), generator=gen)
    p = ids(5)
    torch.testing.assert_close(comp.prefill(p), eager.prefill(p))
    v = ids(3)
    codes = []
    with unittest.mock.patch.object(GraphLowering, "save_output_code", codes.append):
        torch.testing.assert_close(comp.verify(v), eager.verify(v), atol=1e-4, rtol=1e-4)
    # fused C++ kernels only, as the decode step (tests/test_graph_breaks.py): the block solver's
    # products and prefix sums, the router's logits and top-k, the few-row projections
    assert len(codes) == 1
    for call in ("extern_kernels.", "aten.topk", "aten.cumsum", "aten.mm", "aten.bmm"):
        assert call not in codes[0], f"the compiled verify step calls {call}"
    with torch.compiler.set_stance("fail_on_recompile"):
        for i in range(12):
            v, live = ids(2 + i % 2), torch.rand(2, 2 + i % 2, generator=gen) > 0.2
            torch.testing.assert_close(comp.verify(v, live), eager.verify(v, live), atol=1e-4, rtol=1e-4)
            n = torch.tensor([i % 3, (i + 1) % 2]).clamp(max=comp.rollbackable)
            comp.rollback(n)
            eager.rollback(n)
            t = ids(1)[:, 0]
            torch.testing.assert_close(comp.decode(t), eager.decode(t), atol=1e-4, rtol=1e-4)
