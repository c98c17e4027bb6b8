"""Per-row lifecycle of `HostDecoder` (continuous batching): `reset_rows` starts one row at
position 0 while the others keep their state, `step` advances each row by its own live tokens
in either fixed shape. Every row's logits are checked against the float64 oracle run on that
row's tokens alone; bad calls raise and leave the state as it was; compiled steps never
recompile for any mix of rows."""

import random

import pytest
import torch

from helpers import random_model, run_oracle
from shram_static import CapacityError, StaticDecoder

B, C = 3, 4
TOL = 1e-3


@pytest.fixture(scope="module")
def model():
    # capacity 40: rows are restarted before they fill up
    return random_model(11, training_sequence_length=20, inference_sequence_length=40)


def run_schedule(dec, seed: int, steps: int = 24, last_only: bool = False):
    """A random continuous-batching schedule on `dec`: rows join (reset_rows), get prompt
    chunks in prefill-shape steps beside one decode token of the running rows, decode alone,
    go idle, and restart with new sequences. Returns every row's segments as (token ids,
    logits at them), a segment being what a row was fed since its last start. With
    `last_only` (what the server runs) a step returns each row's last live token's logits
    only, and the others are None."""
    rng = random.Random(seed)
    V, S = dec.config.vocab_size, dec.capacity
    segs = [[] for _ in range(B)]  # per row: list of ([ids], [logits])
    state = ["idle"] * B
    for t in range(steps):
        for b in range(B):
            if state[b] == "idle" and rng.random() < 0.5 or (state[b] != "idle" and
                                                             int(dec.live_counts[b]) > S - C - 1):
                dec.reset_rows([b])
                segs[b].append(([], []))
                state[b] = "run"
            elif state[b] == "run" and rng.random() < 0.1:
                state[b] = "idle"  # freed: never live again until restarted
        width = C if t % 3 != 2 else 1
        ids = torch.randint(0, V, (B, width), generator=torch.Generator().manual_seed(seed * 100 + t))
        live = torch.zeros(B, width, dtype=torch.bool)
        running = [b for b in range(B) if state[b] == "run"]
        if running:
            chunk_row = rng.choice(running) if width > 1 else None
            for b in running:
                n = rng.randint(1, C) if b == chunk_row else int(rng.random() < 0.8)
                live[b, :n] = True
        logits = dec.step(ids, live, last_only=last_only)
        if last_only:
            assert logits.shape == (B, 1, V)
        else:
            assert logits.shape == (B, width, V)
        for b in running:
            seg_ids, seg_logits = segs[b][-1]
            n = int(live[b].sum())
            seg_ids += ids[b][live[b]].tolist()
            if last_only:
                seg_logits += [None] * (n - 1) + [logits[b, 0]] if n else []
            else:
                seg_logits += list(logits[b][live[b]])
    return segs


def assert_rows_match_oracle(model, segs):
    n = 0
    for b, row in enumerate(segs):
        for ids, logits in row:
            if not ids:
                continue
            want = run_oracle(model, torch.tensor([ids]))[0][0].float()  # (N, V)
            at = [i for i, lg in enumerate(logits) if lg is not None]
            err = (torch.stack([logits[i] for i in at]) - want[at]).abs().max().item()
            assert err < TOL, f"row {b}, segment of {len(ids)} tokens: max logit error {err}"
            n += 1
    assert n > B and any(sum(bool(ids) for ids, _ in row) >= 2 for row in segs)  # rows restarted


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_join_leave_and_restart_independently(model, seed):
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=C)
    assert_rows_match_oracle(model, run_schedule(dec, seed))


@pytest.mark.heavy
def test_compiled_rows_never_recompile(model):
    """Any mix of joining, running and idle rows runs the same two compiled graphs: the server's
    (`last_only`: the prefill shape's step takes the lm_head of each row's last live token,
    also when that is its first, or a row has none)."""
    torch._dynamo.reset()
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=C, compile=True)
    for width in (1, C):  # compile both shapes once
        dec.step(torch.zeros(B, width, dtype=torch.long), torch.zeros(B, width, dtype=torch.bool), last_only=True)
    assert int(dec.live_counts.sum()) == 0
    with torch.compiler.set_stance("fail_on_recompile"):
        segs = run_schedule(dec, 2, steps=18, last_only=True)
    assert_rows_match_oracle(model, segs)


def snapshot(dec):
    return [t.clone() for t in dec.state.tensors()], dec.live_counts


BAD_STEPS = {
    "width_not_1_or_chunk": (lambda d, V: d.step(torch.zeros(B, 2, dtype=torch.long),
                                                 torch.ones(B, 2, dtype=torch.bool)), ValueError, "prefill_chunk"),
    "wrong_batch": (lambda d, V: d.step(torch.zeros(B + 1, 1, dtype=torch.long),
                                        torch.ones(B + 1, 1, dtype=torch.bool)), ValueError, "shape"),
    "oov": (lambda d, V: d.step(torch.full((B, 1), V), torch.ones(B, 1, dtype=torch.bool)), ValueError, "vocabulary"),
    "float_ids": (lambda d, V: d.step(torch.zeros(B, 1), torch.ones(B, 1, dtype=torch.bool)), TypeError, "dtype"),
    "live_missing": (lambda d, V: d.step(torch.zeros(B, 1, dtype=torch.long), None), TypeError, "live"),
    "live_shape": (lambda d, V: d.step(torch.zeros(B, 1, dtype=torch.long),
                                       torch.ones(B, C, dtype=torch.bool)), ValueError, "shape"),
    "live_values": (lambda d, V: d.step(torch.zeros(B, 1, dtype=torch.long), torch.full((B, 1), 2)),
                    ValueError, "0 and 1"),
    "overflow": (lambda d, V: d.step(torch.zeros(B, C, dtype=torch.long), torch.ones(B, C, dtype=torch.bool)),
                 CapacityError, "capacity"),
    "last_only_not_bool": (lambda d, V: d.step(torch.zeros(B, C, dtype=torch.long), torch.ones(B, C, dtype=torch.bool),
                                               last_only=1), TypeError, "last_only"),
    "row_out_of_range": (lambda d, V: d.reset_rows([0, B]), ValueError, "rows"),
    "row_negative": (lambda d, V: d.reset_rows(-1), ValueError, "rows"),
    "row_float": (lambda d, V: d.reset_rows([0.5]), TypeError, "rows"),
}


@pytest.mark.parametrize("name", list(BAD_STEPS))
def test_bad_step_raises_and_leaves_state(model, name):
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=C)
    V = dec.config.vocab_size
    dec.step(torch.randint(0, V, (B, C)), torch.ones(B, C, dtype=torch.bool))  # non-trivial state
    if name == "overflow":  # fill to within one chunk of capacity first
        while int(dec.live_counts.max()) + C <= dec.capacity:
            dec.step(torch.zeros(B, C, dtype=torch.long), torch.ones(B, C, dtype=torch.bool))
    snap = snapshot(dec)
    call, exc, words = BAD_STEPS[name]
    with pytest.raises(exc, match=words):
        call(dec, V)
    for a, b in zip(snap[0], dec.state.tensors()):
        assert torch.equal(a, b)
    assert torch.equal(snap[1], dec.live_counts)
