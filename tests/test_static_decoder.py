"""StaticDecoder semantics: any split into prefill calls and decode steps gives the uncached
forward's logits and routing (golden cases and random configs); errors leave state untouched;
memory is static."""

import contextlib

import pytest
import torch

from helpers import GOLDEN_CASES, golden_case, random_config, randomize_
from shram_static import CapacityError, ShramForCausalLM, StaticDecoder, state_bytes
from shram_static.layers import Router

TOL = 1e-3


@contextlib.contextmanager
def recorded_routing(model):
    """Within the block, each step's routing of an eager decoder's `model` is appended to the
    list it yields: (layers, B, C, K) experts, -1 at dead tokens (a forward hook on each router)."""
    steps, layers = [], []
    routers = [m for m in model.modules() if isinstance(m, Router)]

    def record(router, args, out):  # args: (h, live, start, taken, k, ...); out: (idx, P)
        layers.append(torch.where(args[1][..., None], out[0], -1))
        if len(layers) == len(routers):
            steps.append(torch.stack(layers))
            layers.clear()
    hooks = [r.register_forward_hook(record) for r in routers]
    try:
        yield steps
    finally:
        for h in hooks:
            h.remove()


def run_split(dec: StaticDecoder, ids, mask, split, active=None):
    """Feeds (ids, mask) through `dec` as prefill calls of the given lengths, then one decode
    step per remaining position. Returns logits (B, N, V) and routing (layers, B, N, K)."""
    out, t = [], 0
    with recorded_routing(dec.module.model) as steps:
        for n in split:
            out.append(dec.prefill(ids[:, t:t + n], mask[:, t:t + n]))
            t += n
        for t in range(t, ids.shape[1]):
            out.append(dec.decode(ids[:, t], mask[:, t])[:, None])
    routing = torch.cat(steps, dim=2)  # chunks are padded: keep live slots
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


# How a step of C > 1 tokens attends (`StepMode.per_token`, from `step.step`'s per_token_max): per
# expert (prefill) or per token (the verify step; here by making it at least the chunk). Both
# must give the same logits.
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
            out.append(dec._run_last(ids, dec.live_counts, live) if last else dec._run(ids, dec.live_counts, live))
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
    # more ids than `validation.SMALL`: checked by torch ops, not Python ints
    "prefill_oov_long": (lambda d, V: d.prefill(torch.cat([torch.zeros(2, 199, dtype=torch.long),
                                                           torch.full((2, 1), V)], 1)), ValueError, "vocabulary"),
    "prefill_overflow_long": (lambda d, V: d.prefill(torch.zeros(2, 150, dtype=torch.long)), CapacityError, "capacity"),
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


def test_skip_guards_is_gone():
    """`skip_guards=` (it never changed anything) is refused as any unknown keyword is."""
    model, g = golden_case("main_basic")
    with pytest.raises(TypeError, match="skip_guards"):
        StaticDecoder(model, batch_size=g["input_ids"].shape[0], prefill_chunk=4, skip_guards=True)
