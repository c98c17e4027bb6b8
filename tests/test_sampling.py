"""`sampling.Sampler`, the one sampler of `generate`, speculative decoding and the server: a valid
token for any finite logits and any temperature > 0 (hypothesis), and greedy's tokens at a tiny
temperature on the eager and the compiled decoder."""

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import compiled_test_model, random_ids, tiny_model
from shram_static import StaticDecoder
from shram_static.sampling import Sampler

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
            nucleus.add(i)
            mass += w[i] / total
            if mass >= top_p * (1 - 1e-9):
                break
        lowest = min(z[i] for i in nucleus)
        keep = {i for i in keep if z[i] >= lowest}  # ties with the nucleus' last token stay
    return keep


@FUZZ
@given(logits_st, temperature_st, top_k_st, top_p_st, st.integers(0, 2**32 - 1))
# logits that differ by less than float64's resolution once scaled: ties for top-p
@example([0.0] * 7 + [3.0, 3.0, 2.301855724784845e16, 3.410168814292173e16, 1.0, 0.0, 0.0], 1.5718266426274672e17,
         None, 0.375, 1)
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
