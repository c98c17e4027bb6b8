"""The uncached forward `ShramForCausalLM(ids, mask)` against the golden cases and the float64
oracle (tests/oracle.py), its properties of docs/design.md, "The network" (causality, batch invariance) and its input
errors."""

import pytest
import torch

from helpers import GOLDEN_CASES, golden_case, random_ids, random_model, run_oracle

from shram_static.entmax import entmax12, entmax12_unrolled
from shram_static.reductions import mean_unrolled


# -- golden parity --------------------------------------------------------------------------
@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden_forward(name):
    model, g = golden_case(name)
    mask = g["attention_mask"].bool()
    out = model(g["input_ids"], mask, output_routing=True)
    assert out.logits.shape == g["logits_full"].shape
    err = (out.logits - g["logits_full"])[mask].abs().max().item()
    assert err <= 1e-3, f"{name}: max abs logit error {err} on live positions"
    sel = out.selected_heads
    assert sel.shape == g["selected_heads"].shape
    assert torch.equal(sel[:, mask], g["selected_heads"][:, mask]), f"{name}: routing differs"
    assert bool((sel[:, ~mask] == -1).all())
    assert bool(out.logits.isfinite().all())


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden_greedy_by_full_forward(name):
    model, g = golden_case(name)
    P = int(g["prompt_len"])
    want = g["greedy_tokens"]
    for b in range(want.shape[0]):
        ids = g["input_ids"][b, :P][g["attention_mask"][b, :P].bool()].tolist()
        got = []
        for _ in range(want.shape[1]):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            got.append(nxt)
            ids.append(nxt)
        assert got == want[b].tolist(), f"{name} row {b}"


def test_golden_mask_formats_agree():
    """bool, int64 and int32 masks mean the same."""
    model, g = golden_case("left_padded")
    mask = g["attention_mask"].bool()
    ref = model(g["input_ids"], mask).logits
    for m in (mask.long(), mask.int()):
        assert torch.equal(model(g["input_ids"], m).logits[mask], ref[mask])


# -- random configs vs the float64 oracle -----------------------------------------------------
# Seeds 0-15 (and 16-39, checked once) all agree with the oracle, routing included: no router
# tie flipped between fp32 and fp64, so no seed had to be skipped.
ORACLE_SEEDS = list(range(16))


def _padded_batch(config, seed, n):
    """Two rows: one all live; one with 3 left pads and 2 dead tokens in the middle."""
    ids = random_ids(config, 2, n, seed)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :3] = False
    mask[1, n // 2: n // 2 + 2] = False
    return ids, mask


@pytest.mark.parametrize("seed", ORACLE_SEEDS)
def test_random_config_matches_oracle(seed):
    model = random_model(seed)
    n = min(model.config.inference_sequence_length, 40)
    ids, mask = _padded_batch(model.config, seed, n)
    ref_logits, ref_sel = run_oracle(model, ids, mask)
    out = model(ids, mask, output_routing=True)
    span = ref_logits[mask].abs().max().item()
    err = (out.logits.double() - ref_logits)[mask].abs().max().item()
    assert err <= 1e-4 * max(1.0, span / 10), f"seed {seed}: logit error {err} (span {span})"
    assert torch.equal(out.selected_heads[:, mask], ref_sel[:, mask]), f"seed {seed}: routing differs"


def test_random_configs_cover_the_space():
    """The oracle seeds above exercise both rope modes, tying, fixed gates, YaRN, W in 1..4."""
    from helpers import random_config
    cfgs = [random_config(s) for s in ORACLE_SEEDS]
    assert {c.rope_mode for c in cfgs} == {"main_sequence", "semantic_sequence"}
    assert {c.tie_word_embeddings for c in cfgs} == {True, False}
    assert {c.use_residual_gate for c in cfgs} == {True, False}
    assert any(c.scale > 1 for c in cfgs) and any(c.scale == 1 for c in cfgs)
    assert {c.block_length for c in cfgs} == {1, 2, 3, 4}


# -- live-token properties (docs/design.md, "The network") on random configs ---------------------------------------------------
@pytest.mark.parametrize("seed", [100, 101, 102, 103, 104, 105])
def test_causality(seed):
    model = random_model(seed)
    n = min(model.config.inference_sequence_length, 30)
    ids = random_ids(model.config, 1, n, seed)
    base = model(ids, output_routing=True)
    for t in (0, 1, n // 3, n // 2, n - 1):
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 1 + t) % model.config.vocab_size
        out = model(changed, output_routing=True)
        torch.testing.assert_close(out.logits[0, :t], base.logits[0, :t], rtol=1e-5, atol=2e-5,
                                   msg=lambda m: f"seed {seed}: changing token {t} changed earlier logits: {m}")
        assert torch.equal(out.selected_heads[:, 0, :t], base.selected_heads[:, 0, :t])
        assert not torch.allclose(out.logits[0, t], base.logits[0, t]), "the changed token had no effect"


@pytest.mark.parametrize("seed", [200, 201, 202, 203, 204, 205])
def test_batch_invariance(seed):
    """Each row of a padded batch (left pads, dead tokens in the middle, garbage ids at dead
    positions) gives the logits and routing it gives alone and unpadded."""
    model = random_model(seed)
    V = model.config.vocab_size
    n = min(model.config.inference_sequence_length, 24)
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, V, (k,), generator=gen) for k in (n, n - 5, n - 9)]
    N = n + 8
    ids = torch.randint(0, V, (3, N), generator=gen)  # garbage everywhere, live tokens placed below
    mask = torch.zeros(3, N, dtype=torch.bool)
    live_cols = [list(range(0, n)),                                 # right-padded
                 list(range(N - (n - 5), N)),                       # left-padded
                 [c for c in range(4, N) if c not in (7, 8, 15, 16, 17)][: n - 9]]  # holes
    for b, cols in enumerate(live_cols):
        assert len(cols) == len(rows[b])
        ids[b, cols] = rows[b]
        mask[b, cols] = True
    out = model(ids, mask, output_routing=True)
    for b, row in enumerate(rows):
        alone = model(row[None], output_routing=True)
        torch.testing.assert_close(out.logits[b, mask[b]], alone.logits[0], rtol=1e-5, atol=2e-5)
        assert torch.equal(out.selected_heads[:, b, mask[b]], alone.selected_heads[:, 0])
    # Changing only dead tokens changes nothing on live ones.
    other = torch.where(mask, ids, (ids + 7) % V)
    torch.testing.assert_close(model(other, mask).logits[mask], out.logits[mask], rtol=1e-5, atol=2e-5)


def test_dead_rows_and_positions_are_finite():
    model = random_model(7)
    ids = random_ids(model.config, 2, 12, 7)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1] = False
    mask[0, 5] = False
    out = model(ids, mask, output_routing=True)
    assert bool(out.logits.isfinite().all())
    assert bool((out.selected_heads[:, 1] == -1).all()) and bool((out.selected_heads[:, 0, 5] == -1).all())


# -- input errors -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    model = random_model(11)
    return model, random_ids(model.config, 2, 6, 11)


@pytest.mark.parametrize("make, exc, words", [
    (lambda ids, V: ids + V, ValueError, ["outside the vocabulary", "[0,"]),
    (lambda ids, V: ids - V, ValueError, ["outside the vocabulary"]),
    (lambda ids, V: ids.float(), TypeError, ["integer", "float32"]),
    (lambda ids, V: ids[0], ValueError, ["2-D", "(batch, length)", "input_ids[None]"]),
    (lambda ids, V: ids[None], ValueError, ["2-D", "(batch, length)"]),
    (lambda ids, V: ids.tolist(), TypeError, ["torch.Tensor", "list"]),
])
def test_bad_input_ids(small, make, exc, words):
    model, ids = small
    with pytest.raises(exc) as e:
        model(make(ids, model.config.vocab_size))
    msg = str(e.value)
    assert "input_ids" in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("make, exc, words", [
    (lambda ids: torch.ones(2, 5, dtype=torch.bool), ValueError, ["shape", "(2, 6)", "(2, 5)"]),
    (lambda ids: torch.ones(6, dtype=torch.bool), ValueError, ["shape"]),
    (lambda ids: torch.ones(2, 6), TypeError, ["bool or integer", "float32"]),
    (lambda ids: torch.full((2, 6), 2), ValueError, ["0 and 1"]),
    (lambda ids: [[1] * 6] * 2, TypeError, ["torch.Tensor"]),
])
def test_bad_attention_mask(small, make, exc, words):
    model, ids = small
    with pytest.raises(exc) as e:
        model(ids, make(ids))
    msg = str(e.value)
    assert "attention_mask" in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("solve", [entmax12, entmax12_unrolled])
def test_entmax12_matches_reference_package(solve):
    """The library's Newton solve (its means as reductions, and as sums of entries for compiled
    steps) against the `entmax` package's 50-halving bisection, over wide and narrow logit
    scales, ties, one dominant expert, odd expert counts, and counts far beyond any shipped
    config (the Newton step count grows with L; too few steps would show here)."""
    entmax = pytest.importorskip("entmax")
    gen = torch.Generator().manual_seed(3)
    for L, scale in ((2, 1.0), (5, 1.0), (8, 0.1), (12, 2.0), (16, 1.0), (16, 30.0), (64, 5.0), (256, 0.3),
                     (1024, 0.3), (4096, 3.0)):
        z = torch.randn(200, L, generator=gen) * scale
        z[0] = 0.0  # all tied: uniform
        z[1, 0] = 100.0  # one expert takes everything
        # logits falling off as powers of the rank: many experts near the threshold, the
        # slowest case for Newton (3 steps instead of the 4 it needs fail here at L = 4096)
        a, b = torch.rand(2, 48, 1, generator=gen)
        z[2:50] = -10 * a * torch.arange(L).float() ** b
        ours = solve(z)
        ref = entmax.entmax_bisect(z, alpha=1.2, dim=-1, n_iter=50)
        assert (ours - ref).abs().max() <= 2e-6, (L, scale, (ours - ref).abs().max())
        assert torch.allclose(ours.sum(-1), torch.ones(200), atol=1e-6)
    assert torch.allclose(solve(torch.zeros(1, 8)), torch.full((1, 8), 1 / 8))


def test_mean_unrolled_is_the_mean_at_every_width():
    """Odd counts carry their last entry up a level; float64 sums of random rows as the oracle."""
    gen = torch.Generator().manual_seed(5)
    for n in range(1, 40):
        y = torch.randn(3, 2, n, generator=gen) * 10
        got = mean_unrolled(y)
        assert got.shape == (3, 2, 1)
        torch.testing.assert_close(got, y.double().sum(-1, keepdim=True).div(n).float(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_slot_bias_is_the_mask_bias_bit_for_bit(dtype):
    """The float-arithmetic sparse mask against the comparison it replaces: slots up to `last`
    visible, every later one and the sink (2**24) never, for gaps of one slot, of thousands and
    near 2**24 (whose product overflows to -inf before the clamp)."""
    from shram_static.attention import attention_bias, slot_bias

    T = 517
    slot_ids = torch.cat([torch.arange(T), torch.tensor([2 ** 24])])  # the step's layout: sink last
    last = torch.tensor([0, 1, 2, 7, T - 2, T - 1, T, T + 40, 2 ** 20, 2 ** 24 - 2])[:, None, None]
    want = attention_bias(slot_ids <= last, dtype)  # (10, 1, T+1)
    got = slot_bias(last, slot_ids.float(), dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert bool((got[..., -1] < 0).all())  # the sink is never visible
    assert bool((got[0, 0, 1:] < 0).all()) and got[0, 0, 0] == 0  # slot 0 only


def test_step_refuses_a_capacity_past_float32_slot_numbers():
    """`slot_bias` compares slot numbers in float32 with the sink at 2**24: a longer context
    would make the sink visible, so the step refuses it before touching any state."""
    from shram_static.step import step

    model = random_model(4)
    model.config.inference_sequence_length = 2 ** 24
    ids = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="inference_sequence_length must be below 2\\*\\*24"):
        step(model, [], ids, torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), 4, True)
