"""`sampling.Sampler`, the one sampler of `generate`, speculative decoding and the server: a valid
token for any finite logits and any temperature > 0 (hypothesis), and greedy's tokens at a tiny
temperature on the eager and the compiled decoder."""

import math

import numpy as np

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import compiled_test_model, random_ids, run_oracle, tiny_model
from shram_static import StaticDecoder
from shram_static.sampling import History, Sampler

# WHY settings here: the suite runs without hypothesis' pytest plugin (pyproject's addopts), so
# no profile is loaded; a fixed seed (derandomize) and no example database keep runs repeatable.
FUZZ = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
logits_st = st.lists(f32, min_size=1, max_size=40)
top_k_st = st.none() | st.integers(1, 50)
top_p_st = st.none() | st.floats(min_value=1e-6, max_value=1.0, exclude_min=False)
temperature_st = st.floats(min_value=5e-324, max_value=1e300, allow_nan=False, allow_infinity=False)


def allowed(x: list[float], top_k, top_p, temperature) -> set[int]:
    """Oracle: the tokens the filters keep, ranked by the scaled logits (x - max) / T in Python
    floats (float64: values that round to the same scaled logit are ties); a superset when a
    cut falls between equal values."""
    m = max(x)
    z = [(v - m) / temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: -z[i])
    keep = set(order)
    if top_k is not None:
        kth = z[order[min(top_k, len(x)) - 1]]
        keep = {i for i in keep if z[i] >= kth}
    if top_p is not None and top_p < 1:
        w = {i: math.exp(max(z[i], -745.0)) for i in keep}
        total = sum(w.values())
        mass, nucleus = 0.0, set()
        for i in sorted(keep, key=lambda i: -z[i]):
            # a token stays while the mass before it is below top_p; within rounding of top_p
            # (float64 sums in another order) it may stay too: the oracle keeps it
            if mass >= top_p * (1 + 1e-9):
                break
            nucleus.add(i)
            mass += w[i] / total
        lowest = min(z[i] for i in nucleus)
        keep = {i for i in keep if z[i] >= lowest}  # ties with the nucleus' last token stay
    return keep


@FUZZ
@given(logits_st, temperature_st, top_k_st, top_p_st, st.integers(0, 2**32 - 1))
# logits that differ by less than float64's resolution once scaled: ties for top-p
@example([0.0] * 7 + [3.0, 3.0, 2.301855724784845e16, 3.410168814292173e16, 1.0, 0.0, 0.0], 1.5718266426274672e17,
         None, 0.375, 1)
# a cut that falls on top_p up to rounding: the 18 equal tokens' mass is 0.9 - 2e-16
@example([0.0] * 18 + [1.0, 1.0], 394796069919808.0, None, 0.1, 1)
def test_sample_is_a_valid_token(x, temperature, top_k, top_p, seed):
    s = Sampler(temperature, top_k, top_p)
    lg = torch.tensor(x, dtype=torch.float32)
    p = s.probs(lg)
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-9
    tok = int(s.sample(lg, torch.Generator().manual_seed(seed)))
    assert 0 <= tok < len(x) and p[tok] > 0
    assert tok in allowed(x, top_k, top_p, temperature)


@FUZZ
@given(logits_st, st.floats(min_value=5e-324, max_value=1e-260), top_k_st, top_p_st, st.integers(0, 2**32 - 1))
def test_tiny_temperature_is_greedy(x, temperature, top_k, top_p, seed):
    """A temperature this small leaves no other token any probability: one of the equal maxima
    (the argmax itself when it is unique)."""
    lg = torch.tensor(x, dtype=torch.float32)
    tok = int(Sampler(temperature, top_k, top_p).sample(lg, torch.Generator().manual_seed(seed)))
    top = max(float(v) for v in lg)
    assert float(lg[tok]) == top
    if sum(float(v) == top for v in lg) == 1:
        assert tok == int(lg.argmax())


@FUZZ
@given(st.lists(logits_st.filter(lambda v: len(v) == 7), min_size=1, max_size=4), temperature_st)
def test_rows_sample_independently_of_their_batch(rows, temperature):
    """(N, V) logits give each row what it gives alone (the server samples rows one by one)."""
    lg = torch.tensor(rows, dtype=torch.float32)
    s = Sampler(temperature)
    torch.testing.assert_close(s.probs(lg), torch.stack([s.probs(r) for r in lg]), rtol=0, atol=0)


def test_bad_settings_raise():
    for kw in ({"temperature": -1.0}, {"temperature": float("nan")}, {"temperature": float("inf")},
               {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            Sampler(**kw)
    with pytest.raises(TypeError):
        Sampler("1")
    assert Sampler(0).greedy and int(Sampler(0).sample(torch.tensor([1.0, 3.0, 3.0]))) == 1


TINY_T = (1e-300, 1e-38, 1e-6)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_generate_at_tiny_temperatures_is_greedy(backend):
    """`generate` with a temperature the API accepts down to 1e-300 (and top-k / top-p) gives
    greedy decoding's tokens; dividing float32 logits by it overflowed to inf, then NaN."""
    model = compiled_test_model(3) if backend == "compiled" else tiny_model()
    dec = StaticDecoder(model, batch_size=1, compile=backend == "compiled")
    ids = random_ids(model.config, 1, 9, seed=5)
    greedy = dec.generate(ids, max_new_tokens=12)
    for T in TINY_T:
        for kw in ({}, {"top_k": 5, "top_p": 0.9}):
            got = dec.generate(ids, max_new_tokens=12, do_sample=True, temperature=T, seed=1, **kw)
            assert torch.equal(got, greedy), (T, kw)


def test_speculative_sampling_at_tiny_temperatures_is_greedy():
    """Speculative sampling (prompt lookup and a draft decoder) at a tiny temperature keeps
    greedy's tokens too."""
    model = tiny_model()
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4, verify_len=4)
    draft = StaticDecoder(tiny_model(seed=9), batch_size=2, prefill_chunk=4, verify_len=4)
    ids = random_ids(model.config, 2, 8, seed=2).repeat(1, 2)  # repeats: prompt lookup guesses
    greedy = dec.generate(ids, max_new_tokens=10)
    for T in TINY_T:
        for kw in ({"speculate": 3}, {"draft": draft}):
            got = dec.generate(ids, max_new_tokens=10, do_sample=True, temperature=T, seed=4, **kw)
            assert torch.equal(got, greedy), (T, kw)


# -- logit_bias and the penalties -------------------------------------------------------------
def adjusted(x, prompt, out, bias, presence, frequency, repetition):
    """Oracle, in numpy float64: vLLM's order, OpenAI's and vLLM's formulas (sampling.py's
    module docstring): bias added; for each token in prompt or output a positive logit divided
    by the repetition penalty, a negative one multiplied; then count * frequency + (count > 0)
    * presence subtracted, counting the output tokens."""
    x = np.array(x, dtype=np.float64)
    for j, b in bias.items():
        x[j] += b
    for j in set(prompt) | set(out):
        x[j] = x[j] / repetition if x[j] > 0 else x[j] * repetition
    counts = np.bincount(np.array(out, dtype=np.int64), minlength=len(x)).astype(np.float64)
    return x - counts * frequency - (counts > 0) * presence


penalty_st = st.floats(-2, 2, allow_nan=False)


@settings(FUZZ, max_examples=60)
@given(st.lists(f32.filter(lambda v: abs(v) < 1e4), min_size=2, max_size=30), st.data(), penalty_st, penalty_st,
       st.floats(0.05, 5.0), st.floats(1e-3, 3.0))
def test_adjustments_match_the_formulas(x, data, presence, frequency, repetition, temperature):
    V = len(x)
    ids = st.integers(0, V - 1)
    prompt, out = data.draw(st.lists(ids, min_size=1, max_size=12)), data.draw(st.lists(ids, max_size=12))
    bias = data.draw(st.dictionaries(ids, st.floats(-100, 100), max_size=4))
    kw = dict(logit_bias=bias, presence_penalty=presence, frequency_penalty=frequency,
              repetition_penalty=repetition)
    seen = History(torch.tensor([prompt]), None, V)
    for t in out:
        seen.add(torch.tensor([t]))
    want = adjusted(x, prompt, out, bias, presence, frequency, repetition)
    lg = torch.tensor([x], dtype=torch.float32)
    got = Sampler(1.0, **kw).adjust(lg, seen)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
    # greedy takes them too: the argmax of the adjusted logits (a near tie excepted)
    top2 = np.sort(want)[-2:]
    if top2[1] - top2[0] > 1e-6:
        assert int(Sampler(0, **kw).sample(lg, None, seen)[0]) == int(want.argmax())
    # and sampling draws from softmax(adjusted / T)
    z = (want - want.max()) / temperature
    p = np.exp(z) / np.exp(z).sum()
    np.testing.assert_allclose(Sampler(temperature, **kw).probs(lg, seen)[0].numpy(), p, rtol=1e-9, atol=1e-12)


def test_bad_adjustments_raise():
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
               {"repetition_penalty": float("inf")}, {"logit_bias": {3: 101}}, {"logit_bias": {-1: 1}},
               {"logit_bias": {5: float("nan")}}, {"logit_bias": {9: 1}, "vocab_size": 9}):
        with pytest.raises(ValueError):
            Sampler(**kw)
    with pytest.raises(TypeError):
        Sampler(logit_bias={"3": 1.0})
    with pytest.raises(ValueError, match="History"):  # a penalty without the tokens seen
        Sampler(presence_penalty=1.0).sample(torch.zeros(4))
    assert Sampler(logit_bias={}).history(torch.tensor([[1]]), None, 4) is None  # nothing to keep


def reference_generate(model, ids: list[int], n: int, **kw) -> list[int]:
    """Oracle: greedy decoding over the float64 reference model's logits of the whole sequence
    at each step, adjusted by `adjusted` (no static state, no Sampler)."""
    out = []
    for _ in range(n):
        x = run_oracle(model, torch.tensor([ids + out]))[0][0, -1].numpy()
        out.append(int(adjusted(x, ids, out, kw.get("logit_bias", {}), kw.get("presence_penalty", 0.0),
                                kw.get("frequency_penalty", 0.0), kw.get("repetition_penalty", 1.0)).argmax()))
    return out


@pytest.mark.parametrize("kw", [{"logit_bias": {7: 6.0, 11: -100.0}},
                                {"presence_penalty": 1.5, "frequency_penalty": 0.7},
                                {"repetition_penalty": 1.8, "logit_bias": {3: 2.5}}])
def test_generate_applies_the_adjustments_greedy(kw):
    """`HostDecoder.generate` (greedy) with each adjustment gives the oracle's tokens, and not
    plain greedy's: each adjustment changes the text."""
    model = tiny_model()
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    ids = random_ids(model.config, 2, 6, seed=3)
    got = dec.generate(ids, max_new_tokens=8, **kw)
    for b in range(2):
        assert got[b].tolist() == reference_generate(model, ids[b].tolist(), 8, **kw), b
    assert not torch.equal(got, dec.generate(ids, max_new_tokens=8))
    with pytest.raises(ValueError, match="speculate"):
        dec.generate(ids, max_new_tokens=4, speculate=2, **kw)


def test_generate_penalises_only_live_prompt_tokens():
    """A padded position (attention_mask 0) is not part of the prompt: its id is not penalised.
    The padding holds the token the penalised greedy picks first, so counting it would change
    that pick."""
    model = tiny_model()
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    ids = random_ids(model.config, 2, 7, seed=8)
    kw = {"repetition_penalty": 3.0}
    first = reference_generate(model, ids[1, 3:].tolist(), 1, **kw)[0]
    assert first not in ids[1, 3:].tolist()
    ids[1, :3] = first
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False
    got = dec.generate(ids, mask, max_new_tokens=6, **kw)
    assert got[0].tolist() == reference_generate(model, ids[0].tolist(), 6, **kw)
    assert got[1].tolist() == reference_generate(model, ids[1, 3:].tolist(), 6, **kw)
