"""StaticDecoder semantics: any split into prefill calls and decode steps gives the uncached
forward's logits and routing (golden cases and random configs); errors leave state untouched;
memory is static."""

import pytest
import torch

from helpers import GOLDEN_CASES, compiled_test_model, golden_case, random_config, randomize_
from shram_static import CapacityError, ShramForCausalLM, StaticDecoder, state_bytes
from shram_static.decoder import FEW_ROWS, RowExperts, RowLinear
from shram_static.layers import BEA, Router
from shram_static.routing import top_k

TOL = 1e-3


def run_split(dec: StaticDecoder, ids, mask, split, active=None):
    """Feeds (ids, mask) through `dec` as prefill calls of the given lengths, then one decode
    step per remaining position. Returns logits (B, N, V) and routing (layers, B, N, K)."""
    dec.module.routing_log = []
    out, t = [], 0
    for n in split:
        out.append(dec.prefill(ids[:, t:t + n], mask[:, t:t + n]))
        t += n
    for t in range(t, ids.shape[1]):
        out.append(dec.decode(ids[:, t], mask[:, t])[:, None])
    routing = torch.cat(dec.module.routing_log, dim=2)  # chunks are padded: keep live slots
    dec.module.routing_log = None
    return torch.cat(out, 1), routing


def live_routing(routing, mask):
    """Routing of live tokens only, in order, per row: list of (layers, n_live_b, K)."""
    return [routing[:, b][:, routing[0, b, :, 0] >= 0] for b in range(mask.shape[0])]


def assert_matches(logits, routing, ref_logits, ref_routing, mask):
    err = (logits - ref_logits)[mask].abs().max().item()
    assert err < TOL, f"max logit error {err}"
    for b, r in enumerate(live_routing(routing, mask)):
        want = ref_routing[:, b][:, mask[b]]
        assert torch.equal(r, want), f"routing of row {b} differs"


SPLITS = {  # (prefill chunk, prefill call lengths); the rest is decoded token by token
    "one_call": (64, None),
    "chunk3_starts_mid_block": (3, (5, 6)),
    "chunk7_three_calls": (7, (1, 9, 10)),
    "decode_only": (4, ()),
}


# How a step of C > 1 tokens attends (`step.step`'s per_token_max): per expert (prefill) or per
# token (the verify step; here by making it at least the chunk). Both must give the same logits.
PATHS = {"per_expert": lambda chunk: None, "per_token": lambda chunk: max(chunk, 2)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", GOLDEN_CASES)
@pytest.mark.parametrize("split", list(SPLITS))
def test_golden_chunking_invariance(case, split, path):
    model, g = golden_case(case)
    ids, mask = g["input_ids"], g["attention_mask"]
    chunk, calls = SPLITS[split]
    calls = (ids.shape[1],) if calls is None else calls
    dec = StaticDecoder(model, batch_size=ids.shape[0], prefill_chunk=chunk, verify_len=PATHS[path](chunk))
    assert dec.module.per_token_max == (1 if path == "per_expert" else max(chunk, 2))
    logits, routing = run_split(dec, ids, mask, calls)
    assert_matches(logits, routing, g["logits_full"], g["selected_heads"], mask)


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_greedy_generate(case):
    model, g = golden_case(case)
    P = int(g["prompt_len"])
    dec = StaticDecoder(model, batch_size=g["input_ids"].shape[0], prefill_chunk=5)
    toks = dec.generate(g["input_ids"][:, :P], g["attention_mask"][:, :P], max_new_tokens=12)
    assert torch.equal(toks, g["greedy_tokens"])
    # A second generate (which resets) gives the same tokens: nothing stale leaks through.
    assert torch.equal(dec.generate(g["input_ids"][:, :P], g["attention_mask"][:, :P], max_new_tokens=12),
                       g["greedy_tokens"])


def random_batch(cfg, B, N, seed, pad_left=(), holes=()):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, N), generator=gen)
    mask = torch.ones(B, N, dtype=torch.bool)
    for b, n in enumerate(pad_left):
        mask[b, :n] = False
    for b, t in holes:
        mask[b, t] = False
    return ids, mask


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("seed", range(6))
def test_random_chunking_invariance(seed, path):
    """Random configs; rows with different left padding and dead tokens mid-row; a sequence
    long enough to wrap the local ring several times; prefill calls starting mid-block."""
    gen = torch.Generator().manual_seed(seed)
    chunk = int(torch.randint(2, 6, (1,), generator=gen))
    cfg = random_config(seed, window_size=int(torch.randint(2, 5, (1,), generator=gen)),
                        training_sequence_length=64, inference_sequence_length=64 * (1 + seed % 2))
    ring = cfg.window_size + chunk - 1
    N = min(3 * ring + 9, cfg.inference_sequence_length)
    model = randomize_(ShramForCausalLM(cfg), seed)
    ids, mask = random_batch(cfg, 3, N, seed, pad_left=(0, 3, 7), holes=((0, 4), (2, N - 3)))
    ref = model(ids, mask, output_routing=True)
    dec = StaticDecoder(model, batch_size=3, prefill_chunk=chunk, verify_len=PATHS[path](chunk))
    W = cfg.block_length
    logits, routing = run_split(dec, ids, mask, (W + 1, chunk * 2 + 1, 1))
    assert_matches(logits, routing, ref.logits, ref.selected_heads, mask)


def test_prefill_last_only_is_each_rows_last_live_token():
    """`last_only` (what generate uses) returns the uncached forward's logits at each row's last
    live token, also when that token lies chunks before the end (right padding) or a later
    chunk is all dead; the state it leaves is the same as a full prefill's."""
    cfg = random_config(7, training_sequence_length=48)
    model = randomize_(ShramForCausalLM(cfg), 7)
    ids, mask = random_batch(cfg, 3, 19, 7, pad_left=(0, 2, 5), holes=((0, 18), (1, 9)))
    mask[2, 9:] = False  # row 2 ends 10 tokens early: its last live token is in chunk 3 of 5
    ref = model(ids, mask).logits
    want = torch.stack([ref[b, int(torch.nonzero(mask[b])[-1])] for b in range(3)])
    full, last = StaticDecoder(model, batch_size=3, prefill_chunk=4), StaticDecoder(model, batch_size=3, prefill_chunk=4)
    got = last.prefill(ids, mask, last_only=True)
    assert got.shape == (3, cfg.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    full.prefill(ids, mask)
    tok = torch.tensor([1, 2, 3])
    torch.testing.assert_close(last.decode(tok), full.decode(tok), atol=0, rtol=0)


def test_prefill_last_only_runs_the_head_for_one_token_per_row():
    """With `last_only` a chunk's lm_head multiplies one row per batch row, not B x C (what a
    prompt's prefill saves: the head was about half of a 50k-vocabulary model's chunk): the
    step's matmul FLOPs drop by exactly (B*C - B) * d * V * 2, and its logits are the full
    step's at each row's last live token."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = random_config(12, training_sequence_length=48)
    model = randomize_(ShramForCausalLM(cfg), 12)
    B, C, d, V = 3, 5, cfg.embedding_width, cfg.vocab_size
    ids = torch.randint(0, V, (B, C), generator=torch.Generator().manual_seed(12))
    live = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 0, 1, 0]], dtype=torch.bool)
    flops, out = [], []
    for last in (False, True):
        dec = StaticDecoder(model, batch_size=B, prefill_chunk=C)
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            out.append(dec._run_last(ids, dec._count, live) if last else dec._run(ids, dec._count, live))
        flops.append(fc.get_total_flops())
    assert flops[0] - flops[1] == (B * C - B) * d * V * 2
    assert out[1].shape == (B, 1, V)
    torch.testing.assert_close(out[1][:, 0], out[0][torch.arange(B), torch.tensor([4, 1, 3])], atol=1e-5, rtol=1e-5)


def test_rows_going_dead_mid_generation():
    """A row made inactive for some decode steps changes nothing; when it resumes its logits are
    those of the uncached forward over its live tokens only."""
    cfg = random_config(11, training_sequence_length=48)
    model = randomize_(ShramForCausalLM(cfg), 11)
    ids, mask = random_batch(cfg, 2, 30, 11)
    mask[1, 10:17] = False  # row 1 inactive for 7 decode steps
    ref = model(ids, mask, output_routing=True)
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    logits, routing = run_split(dec, ids, mask, (6,))
    assert_matches(logits, routing, ref.logits, ref.selected_heads, mask)
    assert dec.live_counts.tolist() == [30, 23]


def test_generate_stops_rows_at_eos_and_pads():
    cfg = random_config(5)
    model = randomize_(ShramForCausalLM(cfg), 5)
    ids, mask = random_batch(cfg, 2, 6, 5)
    free = StaticDecoder(model, batch_size=2, prefill_chunk=4).generate(ids, mask, max_new_tokens=8)
    eos = int(free[0, 2])  # make row 0's third token the EOS
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4, eos_token_id=eos)
    out = dec.generate(ids, mask, max_new_tokens=8, pad_token_id=cfg.vocab_size - 1)
    first = (free[0] == eos).nonzero()[0, 0].item()
    assert torch.equal(out[0, :first + 1], free[0, :first + 1])
    assert (out[0, first + 1:] == cfg.vocab_size - 1).all()
    for b in range(2):  # each row is greedy-identical up to (and including) its first EOS
        stop = (free[b] == eos).nonzero()
        n = stop[0, 0].item() + 1 if len(stop) else 8
        assert torch.equal(out[b, :n], free[b, :n])


def test_sampling_is_seeded_and_respects_top_k():
    cfg = random_config(6)
    model = randomize_(ShramForCausalLM(cfg), 6)
    ids, mask = random_batch(cfg, 1, 5, 6)
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=4)
    a = dec.generate(ids, mask, max_new_tokens=6, do_sample=True, temperature=1.5, seed=3)
    b = dec.generate(ids, mask, max_new_tokens=6, do_sample=True, temperature=1.5, seed=3)
    assert torch.equal(a, b)
    greedy = dec.generate(ids, mask, max_new_tokens=6)
    assert torch.equal(dec.generate(ids, mask, max_new_tokens=6, top_k=1, seed=0), greedy)


# -- errors leave the state exactly as it was ----------------------------------------------
def snapshot(dec):
    return [t.clone() for t in dec.state.tensors()], dec.live_counts


def assert_unchanged(dec, snap):
    tensors, counts = snap
    for a, b in zip(tensors, dec.state.tensors()):
        assert torch.equal(a, b)
    assert torch.equal(counts, dec.live_counts)


@pytest.fixture(scope="module")
def used_decoder():
    cfg = random_config(3, training_sequence_length=24, inference_sequence_length=24)
    model = randomize_(ShramForCausalLM(cfg), 3)
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    ids, mask = random_batch(cfg, 2, 10, 3)
    dec.prefill(ids, mask)  # state is non-trivial
    return dec


BAD_CALLS = {
    "prefill_overflow": (lambda d, V: d.prefill(torch.zeros(2, 15, dtype=torch.long)), CapacityError, "capacity"),
    "decode_overflow_after_fill": None,  # covered below
    "prefill_oov": (lambda d, V: d.prefill(torch.full((2, 3), V)), ValueError, "vocabulary"),
    "prefill_negative": (lambda d, V: d.prefill(torch.full((2, 3), -1)), ValueError, "vocabulary"),
    "decode_oov": (lambda d, V: d.decode(torch.tensor([0, V])), ValueError, "vocabulary"),
    "wrong_batch": (lambda d, V: d.prefill(torch.zeros(3, 4, dtype=torch.long)), ValueError, "batch_size"),
    "float_ids": (lambda d, V: d.prefill(torch.zeros(2, 4)), TypeError, "dtype"),
    "rank_1_prompt": (lambda d, V: d.prefill(torch.zeros(4, dtype=torch.long)), ValueError, "2-D"),
    "rank_2_decode": (lambda d, V: d.decode(torch.zeros(2, 1, dtype=torch.long)), ValueError, "shape"),
    "empty_prompt": (lambda d, V: d.prefill(torch.zeros(2, 0, dtype=torch.long)), ValueError, "empty"),
    "mask_shape": (lambda d, V: d.prefill(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3)), ValueError, "shape"),
    "mask_values": (lambda d, V: d.prefill(torch.zeros(2, 4, dtype=torch.long), torch.full((2, 4), 2)), ValueError, "0 and 1"),
    "generate_no_live_row": (lambda d, V: d.generate(torch.zeros(2, 3, dtype=torch.long),
                                                     torch.tensor([[1, 1, 1], [0, 0, 0]])), ValueError, "live prompt token"),
    "generate_too_long": (lambda d, V: d.generate(torch.zeros(2, 20, dtype=torch.long), max_new_tokens=6), CapacityError, "capacity"),
    "not_a_tensor": (lambda d, V: d.prefill([[1, 2]]), TypeError, "torch.Tensor"),
    "last_only_not_bool": (lambda d, V: d.prefill(torch.zeros(2, 3, dtype=torch.long), last_only=1), TypeError, "last_only"),
}


@pytest.mark.parametrize("name", [k for k, v in BAD_CALLS.items() if v is not None])
def test_bad_input_raises_and_leaves_state(used_decoder, name):
    call, exc, words = BAD_CALLS[name]
    snap = snapshot(used_decoder)
    with pytest.raises(exc, match=words):
        call(used_decoder, used_decoder.config.vocab_size)
    assert_unchanged(used_decoder, snap)


def test_decode_at_capacity_raises_and_leaves_state():
    cfg = random_config(4, training_sequence_length=12, inference_sequence_length=12)
    model = randomize_(ShramForCausalLM(cfg), 4)
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=4)
    dec.prefill(torch.zeros(1, 12, dtype=torch.long))
    snap = snapshot(dec)
    with pytest.raises(CapacityError, match="capacity"):
        dec.decode(torch.zeros(1, dtype=torch.long))
    assert_unchanged(dec, snap)
    dec.decode(torch.zeros(1, dtype=torch.long), active=torch.tensor([False]))  # inactive: fine
    # An inactive row is a no-op: every readable slot is as it was (its writes went to the
    # sink rows, which are never read).
    for a, b in zip(readable(dec, snap[0]), readable(dec, dec.state.tensors())):
        assert torch.equal(a, b)
    assert torch.equal(snap[1], dec.live_counts)


def readable(dec, tensors):
    """The state without its write-sink rows."""
    cfg, st = dec.config, dec.state
    B, H, L, u = dec.batch_size, cfg.num_sliding_window_heads, cfg.num_mosrah_heads, cfg.head_dim
    out = []
    for name, t in zip(st.names(), tensors):
        if name.endswith(("local_k", "local_v")):
            t = t.view(B, H, st.ring + 1, u)[:, :, :st.ring]
        elif name.endswith(("sparse_k", "sparse_v")):
            t = t.view(B, L, st.sparse_len + 1, u)[:, :, :st.sparse_len]
        elif name.endswith("routes"):
            t = t.view(B, st.history + 1, -1)[:, :st.history]
        out.append(t)
    return out


# -- memory is static ----------------------------------------------------------------------
def test_state_bytes_match_formula_and_never_grow():
    cfg = random_config(8, training_sequence_length=40, inference_sequence_length=40)
    B, C = 2, 3
    model = randomize_(ShramForCausalLM(cfg), 8)
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=C, verify_len=None)
    H, L, K, u, n = (cfg.num_sliding_window_heads, cfg.num_mosrah_heads, cfg.num_selected_heads,
                     cfg.head_dim, cfg.num_decoder_layers)
    ring, T, hist = cfg.window_size + C - 1, cfg.mosrah_cache_length, C + cfg.block_length - 1
    by_hand = n * (8 * B * (hist + 1) * K + 4 * (2 * B * H * (ring + 1) * u + 2 * B * L * (T + 1) * u))
    assert dec.state.nbytes() == state_bytes(cfg, B, C) == by_hand
    # A rollback limit above C grows the ring and the routing history by the difference.
    more = by_hand + n * (8 * B * 2 * K + 4 * 2 * B * H * 2 * u)
    assert StaticDecoder(model, batch_size=B, prefill_chunk=C, verify_len=5).state.nbytes() == more
    assert state_bytes(cfg, B, C, rollback_limit=5) == more
    before = [(name, t.data_ptr(), tuple(t.shape)) for name, t in dec.state.named_buffers()]
    ids, mask = random_batch(cfg, B, 40, 8)
    dec.prefill(ids[:, :25], mask[:, :25])
    for t in range(25, 40):
        dec.decode(ids[:, t])
    after = [(name, t.data_ptr(), tuple(t.shape)) for name, t in dec.state.named_buffers()]
    assert before == after
    assert dec.state.nbytes() == by_hand


def test_steps_get_canonical_contiguous_inputs(monkeypatch):
    """A compiled step guards on input strides: every call must see the same strides whatever
    the caller's tensor layout, or it recompiles (seen: one-row prompts recompiled per chunk)."""
    cfg = random_config(9, training_sequence_length=64, inference_sequence_length=64)
    dec = StaticDecoder(randomize_(ShramForCausalLM(cfg), 9), batch_size=1, prefill_chunk=4)
    seen = set()
    real = dec._run

    def spy(tokens, input_pos, live):
        seen.add(tuple((tuple(t.shape), t.stride(), t.storage_offset()) for t in (tokens, input_pos, live)))
        return real(tokens, input_pos, live)

    monkeypatch.setattr(dec, "_run", spy)
    big = torch.randint(0, cfg.vocab_size, (1, 64))
    dec.prefill(big[:, 3:14])
    dec.prefill(big[:, 20:27].t().contiguous().t())
    for t in range(30, 35):
        dec.decode(big[:, t])
        dec.decode(big[0, t:t + 1].expand(1))
    shapes = {s[0][0] for s in seen}
    assert shapes == {(1, 4), (1, 1)}
    assert len(seen) == 2, seen


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_row_linear_equals_linear(dtype, tol):
    """The compiled decode's projection, eager and compiled, against a float64 product: one,
    four and FEW_ROWS rows over its packed weight (300 outputs: the last block padded), also
    from a column-major weight; more rows take F.linear on the weight itself."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 96, generator=gen).to(dtype)
    lin, lin_cm = RowLinear(w), RowLinear(w.t().contiguous().t())  # the second column-major
    assert lin.packed.shape == (19, 96, 16) and torch.equal(lin.packed, lin_cm.packed)
    compiled = torch.compile(lin, fullgraph=True, dynamic=False)
    for rows in (1, 4, FEW_ROWS):
        x = torch.randn(rows, 1, 96, generator=gen).to(dtype)
        want = (x.double() @ w.double().t()).float()
        for f in (lin, lin_cm, compiled):
            got = f(x)
            assert got.dtype == dtype and got.shape == (rows, 1, 300)
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    many = torch.randn(FEW_ROWS + 1, 96, generator=gen).to(dtype)
    torch.testing.assert_close(lin(many), torch.nn.functional.linear(many, w), atol=0, rtol=0)


def test_row_linear_repack():
    """`repack` follows a weight written in place (same buffer, which a compiled step keeps
    reading) or replaced by another dtype (a new buffer); until then the packed copy is the
    weight as it was packed."""
    gen = torch.Generator().manual_seed(6)
    w = torch.nn.Parameter(torch.randn(40, 24, generator=gen), requires_grad=False)
    lin = RowLinear(w)
    buf, x = lin.packed, torch.randn(2, 24, generator=gen)
    old = x @ w.t()
    with torch.no_grad():
        w.mul_(-2)
    torch.testing.assert_close(lin(x), old, atol=1e-5, rtol=1e-5)  # not followed yet
    lin.repack()
    assert lin.packed is buf
    torch.testing.assert_close(lin(x), x @ w.t(), atol=1e-5, rtol=1e-5)
    w.data = w.data.double()
    lin.repack()
    assert lin.packed.dtype == torch.float64 and lin.packed is not buf
    torch.testing.assert_close(lin(x.double()), x.double() @ w.t(), atol=1e-5, rtol=1e-5)  # fp32 sums


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_row_experts_project_equals_experts(dtype, tol):
    """The compiled steps' expert projections, eager and compiled, against a float64 product of
    each token's selected experts' own weights: 1 and FEW_ROWS / 2 tokens per row (each token's
    blocks) and more than FEW_ROWS (every expert, then each token's picked), repeated and
    distinct experts; `repack`
    follows a weight written in place, on both paths."""
    gen = torch.Generator().manual_seed(9)
    cfg = random_config(9)
    L, d, u, K = cfg.num_mosrah_heads, cfg.embedding_width, cfg.head_dim, cfg.num_selected_heads
    bea = BEA(cfg).requires_grad_(False)
    for w in (bea.q_proj, bea.k_proj, bea.v_proj, bea.o_proj):
        w.copy_(torch.randn(w.shape, generator=gen))
    bea = bea.to(dtype)
    row = RowExperts(bea)
    compiled = torch.compile(row.project, fullgraph=True, dynamic=False)

    def want(h, idx):
        return [torch.einsum("bcd,bckdu->bcku", h.double(), w.double()[idx]).float()
                for w in (bea.q_proj, bea.k_proj, bea.v_proj)]

    for C in (1, FEW_ROWS // 2, 16):
        h = torch.randn(2, C, d, generator=gen).to(dtype)
        idx = torch.randint(0, L, (2, C, K), generator=gen)
        idx[0, 0] = idx[0, 0, 0]  # one token with one expert K times
        for f in (row.project, compiled):
            got = f(h, idx)
            for g, w in zip(got, want(h, idx)):
                assert g.dtype == dtype and g.shape == (2, C, K, u)
                torch.testing.assert_close(g.float(), w, atol=tol * d ** 0.5, rtol=tol)
    buf = row.qkv
    with torch.no_grad():
        bea.v_proj.mul_(-2)
    row.repack()
    assert row.qkv is buf
    for h, idx in ((h, idx), (h[:, :2], idx[:, :2])):
        for g, w in zip(row.project(h, idx), want(h, idx)):
            torch.testing.assert_close(g.float(), w, atol=tol * d ** 0.5, rtol=tol)


def test_compiled_decoder_follows_weight_changes():
    """Weights changed after a compiled decoder was built, in place (as `load_state_dict`
    writes them) or replaced by new tensors (`.data`), are what its next prefill, decode and
    verify steps read (its RowLinears and RowExperts pack them again): the logits equal the uncached
    forward's of the changed model. A stale packed copy would give the old model's; the
    experts' weights are changed on their own once, so a stale expert copy shows alone."""
    model = compiled_test_model(7)
    dec = StaticDecoder(model, compile=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))

    def run():
        dec.reset()
        out = [dec.prefill(ids[:, :5])[:, -1]]
        out += [dec.decode(ids[:, t]) for t in range(5, 7)]
        out += list(dec.verify(ids[:, 7:12]).unbind(1))  # logits after tokens 7..11
        return torch.stack(out, 1)  # (1, 8, V): after tokens 4..11

    def want():
        with torch.no_grad():
            return model(ids).logits[:, 4:]

    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)
    before = run()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        model.load_state_dict({k: v * (1 + 0.5 * torch.rand(v.shape, generator=gen))
                               for k, v in model.state_dict().items() if k.endswith("proj.weight")}, strict=False)
    changed = run()
    assert (changed - before).abs().max() > 100 * TOL  # the change shows in the logits
    torch.testing.assert_close(changed, want(), atol=TOL, rtol=0)
    for lin in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        lin.weight.data = -lin.weight.data  # a new tensor each
    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)
    experts = [m for m in model.modules() if isinstance(m, BEA)]
    before = run()
    with torch.no_grad():
        for bea in experts:  # in place, one projection each way
            bea.k_proj.mul_(1 + 0.5 * torch.rand(bea.k_proj.shape, generator=gen))
    changed = run()
    assert (changed - before).abs().max() > 100 * TOL
    torch.testing.assert_close(changed, want(), atol=TOL, rtol=0)
    for bea in experts:  # replaced
        bea.v_proj.data = -bea.v_proj.data
    torch.testing.assert_close(run(), want(), atol=TOL, rtol=0)


@pytest.mark.parametrize("L, k", [(4, 2), (16, 4), (8, 1), (6, 6)])
def test_top_k_as_ranks_is_top_k(L, k):
    """The compiled decode step's top-k (ranks, fused by Inductor) against a sort: largest
    first, taken (-inf) experts last, a tie to the lower index; eager and compiled."""
    gen = torch.Generator().manual_seed(L * 10 + k)
    z = torch.randn(5, 3, L, generator=gen)
    z[0, :, :L // 2] = float("-inf")  # half the experts taken
    z[1, 0] = 0.5  # all tied
    z[2, 1, 1:3] = z[2, 1, 0]  # a tie at the top
    want = torch.tensor([[sorted(range(L), key=lambda i: (-z[b, c, i].item(), i))[:k] for c in range(3)]
                         for b in range(5)])
    for f in (top_k, torch.compile(top_k, fullgraph=True, dynamic=False)):
        got = f(z, k, True)
        assert got.dtype == torch.long and torch.equal(got, want)
    torch.testing.assert_close(top_k(z[3:], k), want[3:], atol=0, rtol=0)  # untied rows: = topk


@pytest.mark.parametrize("tied", [False, True])
def test_decoders_never_alter_the_model(tied):
    """Building decoders (eager, compiled batch 1 and 2 with their RowLinear swap)
    leaves the caller's module tree, weights, layouts and mode as they were; the decoders
    hold the same weight tensors (no copy; a RowLinear's packed layout is its own), an eager
    decoder's steps the unswapped layers; two decoders on one model both stay correct."""
    model = randomize_(ShramForCausalLM(random_config(4, tie_word_embeddings=tied)), 4)
    model.train()
    before = {k: (v.clone(), v.stride(), v.data_ptr()) for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    decs = [StaticDecoder(model, batch_size=1), StaticDecoder(model, batch_size=1, compile=True),
            StaticDecoder(model, batch_size=2, compile=True)]
    assert [type(m) for m in model.modules()] == types and model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k][0]) and (v.stride(), v.data_ptr()) == before[k][1:], k
    ptrs = {p.data_ptr() for p in model.parameters()}
    for dec in decs[1:]:
        swapped = [m for m in dec.module.model.modules() if isinstance(m, RowLinear)]
        assert len(swapped) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) + tied
        assert all(m.weight.data_ptr() in ptrs for m in swapped), "a decoder copied a weight"
        experts = [m for m in dec.module.model.modules() if isinstance(m, RowExperts)]
        assert len(experts) == model.config.num_decoder_layers
        assert all(w.data_ptr() in ptrs for m in experts for w in (*m.sources, m.o_proj))
        routers = [m for m in dec.module.model.modules() if isinstance(m, Router)]
        assert len(routers) == model.config.num_decoder_layers and all(r.fused for r in routers)
    eager = decs[0].module.model.modules()
    assert not any(isinstance(m, (RowLinear, RowExperts)) or getattr(m, "fused", False) for m in eager)
    assert not any(m.fused for m in model.modules() if isinstance(m, Router))
    # two eager decoders on one model, interleaved, each equal to the uncached forward
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    want = model(ids).logits
    a, b = StaticDecoder(model, batch_size=1, prefill_chunk=4), StaticDecoder(model, batch_size=1, prefill_chunk=3)
    la, lb = a.prefill(ids[:, :5]), b.prefill(ids[:, :5])
    la = torch.cat([la, a.prefill(ids[:, 5:])], 1)
    lb = torch.cat([lb, b.prefill(ids[:, 5:])], 1)
    torch.testing.assert_close(la, want, atol=TOL, rtol=0)
    torch.testing.assert_close(lb, want, atol=TOL, rtol=0)


def _profiled(fn) -> set[str]:
    """The names of the profiler events a call of fn records."""
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events()}


def test_compiled_steps_run_their_frame_code_once_checked(monkeypatch):
    """Once a compiled step has run with Dynamo's guards checked, the decoder calls the step's
    compiled frame code itself (`frames.DirectFrame`, accelerator `direct_frame`): no Dynamo
    frame evaluation in a decode or verify step, and the logits of the uncached forward. Dynamo
    runs the call again under `force_eager` (no compiled graph then), after
    `torch._dynamo.reset()` (the step compiles again) and with the accelerator turned off."""
    model = compiled_test_model(13)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want = model(ids).logits
    # Dynamo's frame evaluation records these (a lookup, a compiled region)
    dynamo = lambda events: any(e == "TorchDynamo Cache Lookup" or e.startswith("Torch-Compiled Region")  # noqa: E731
                                for e in events)
    dec = StaticDecoder(model, compile=True)
    dec.prefill(ids[:, :4])
    torch.testing.assert_close(dec.decode(ids[:, 4]), want[:, 4], atol=TOL, rtol=0)  # guards checked
    events = _profiled(lambda: torch.testing.assert_close(dec.decode(ids[:, 5]), want[:, 5], atol=TOL, rtol=0))
    assert not dynamo(events) and any("CompiledFxGraph" in e for e in events)
    torch.testing.assert_close(dec.verify(ids[:, 6:9]), want[:, 6:9], atol=TOL, rtol=0)
    dec.rollback(3)
    events = _profiled(lambda: torch.testing.assert_close(dec.verify(ids[:, 6:9]), want[:, 6:9], atol=TOL, rtol=0))
    assert not dynamo(events) and any("CompiledFxGraph" in e for e in events)
    dec.rollback(3)
    with torch.compiler.set_stance("force_eager"):
        events = _profiled(lambda: torch.testing.assert_close(dec.verify(ids[:, 6:9]), want[:, 6:9],
                                                              atol=TOL, rtol=0))
    assert not any("CompiledFxGraph" in e for e in events)
    dec.rollback(3)
    torch._dynamo.reset()
    events = _profiled(lambda: torch.testing.assert_close(dec.verify(ids[:, 6:9]), want[:, 6:9], atol=TOL, rtol=0))
    assert dynamo(events)  # the frame code of the cleared cache is not called: the step compiles again
    monkeypatch.setenv("SHRAM_STATIC_STOCK", "direct_frame")
    stock = StaticDecoder(model, compile=True)
    stock.prefill(ids[:, :4])
    stock.decode(ids[:, 4])
    events = _profiled(lambda: torch.testing.assert_close(stock.decode(ids[:, 5]), want[:, 5], atol=TOL, rtol=0))
    assert dynamo(events)


def test_two_compiled_decoders_interleaved_run_their_own_frames():
    """Two compiled decoders of different configs in one process (their steps share code
    objects, so Dynamo caches an entry per decoder), called in turn once their guards have
    passed: each step runs its own decoder's compiled frame (`frames.DirectFrame`), with that
    model's logits."""
    # the first: the config (and decode graph) of the tests above
    models = [compiled_test_model(14), randomize_(ShramForCausalLM(random_config(15, num_decoder_layers=1)), 15).eval()]
    assert models[0].config.to_dict() != models[1].config.to_dict()
    decs = [StaticDecoder(m, compile=True) for m in models]
    ids = [torch.randint(0, m.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3)) for m in models]
    with torch.no_grad():
        want = [m(i).logits for m, i in zip(models, ids)]
    for t in range(9):  # decode steps only: one compile per decoder
        for d, i, w in zip(decs, ids, want):
            torch.testing.assert_close(d.decode(i[:, t]), w[:, t], atol=TOL, rtol=0)


class _ChangesAWeight:
    """A streamer that negates a weight in place when the n-th token column arrives (the prompt
    is put first): the caller's code between two steps of `generate`."""

    def __init__(self, weight: torch.Tensor, n: int):
        self.weight, self.n, self.puts = weight, n, 0

    def put(self, value):
        self.puts += 1
        if self.puts == self.n + 1:
            with torch.no_grad():
                self.weight.neg_()

    def end(self):
        pass


@pytest.mark.parametrize("speculate", [None, 3])
def test_generate_checks_each_step_once_unless_a_streamer_runs_between_steps(monkeypatch, speculate):
    """Without a streamer nothing but `generate` runs between its steps, so a compiled decoder
    checks its weights (`decoder._stamps`) once per kind of step and call (`StaticDecoder._steady`).
    With a streamer every step is checked: a weight the streamer changes in place mid-generation
    is what the next step reads (the tokens equal an eager decoder's under the same streamer,
    and differ from the unchanged model's)."""
    from shram_static import decoder as D

    model = compiled_test_model(21)  # the graphs of the tests above
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(21))
    ids = torch.cat([ids, ids], 1)  # a prompt that repeats: prompt lookup has guesses
    w = model.model.layers[-1].mlp.down_proj.weight  # a RowLinear's source in the compiled copy
    kept = w.detach().clone()
    comp = StaticDecoder(model, compile=True)
    eager = StaticDecoder(model)
    calls = []
    stamps = D._stamps
    monkeypatch.setattr(D, "_stamps", lambda w: calls.append(1) or stamps(w))
    plain = comp.generate(ids, max_new_tokens=16, speculate=speculate)
    calls.clear()
    assert torch.equal(comp.generate(ids, max_new_tokens=16, speculate=speculate), plain)
    kinds = 2 if speculate is None else 3  # the prompt's chunks, decode (and verify) steps
    assert len(calls) == kinds
    got = comp.generate(ids, max_new_tokens=16, speculate=speculate, streamer=_ChangesAWeight(w, 6))
    assert len(calls) > kinds + 8  # every step checked
    with torch.no_grad():
        w.copy_(kept)
    want = eager.generate(ids, max_new_tokens=16, speculate=speculate, streamer=_ChangesAWeight(w, 6))
    with torch.no_grad():
        w.copy_(kept)
    assert torch.equal(got, want) and not torch.equal(got, plain)
    assert torch.equal(got[:, :6], plain[:, :6])
