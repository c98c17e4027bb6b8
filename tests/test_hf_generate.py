"""transformers `generate()` on the static state (`ShramCache`): greedy, sampling, beam search,
padding, EOS, logits processors, cache continuation, capacity and rejected modes.

References are independent of the cached path: the golden greedy tokens of the original code,
`StaticDecoder.generate` (the host loop), and `generate(use_cache=False)`, which runs the
verified uncached forward over the whole sequence at every step.
"""

import pytest
import torch
from helpers import GOLDEN_CASES, golden_case, random_ids, random_model, recorded_builds
from torch._inductor.async_compile import get_compile_threads
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache

from shram_static import CapacityError, ShramCache, StaticDecoder
from shram_static.accelerators import enabled


def _new(out, P):
    return out[:, P:]


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_greedy_matches_golden_static_decoder_and_uncached(name):
    model, g = golden_case(name)
    ids, mask, P = g["input_ids"], g["attention_mask"], int(g["prompt_len"])
    ids, mask = ids[:, :P], mask[:, :P]
    want = g["greedy_tokens"]
    n = want.shape[1]
    # prefill_chunk 4: the prompt runs as several fixed-size chunks, the last one padded.
    cache = ShramCache(model.config, ids.shape[0], prefill_chunk=4)
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, cache=cache)
    assert torch.equal(cached[:, :P], ids)
    assert torch.equal(_new(cached, P), want)
    default_cache = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    assert torch.equal(_new(default_cache, P), want)
    # transformers' own chunked prefill (prefill_chunk_size also sizes the generated cache)
    hf_chunks = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, prefill_chunk_size=5)
    assert torch.equal(_new(hf_chunks, P), want)
    uncached = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, use_cache=False)
    assert torch.equal(_new(uncached, P), want)
    dec = StaticDecoder(model, batch_size=ids.shape[0], prefill_chunk=4)
    assert torch.equal(dec.generate(ids, mask, max_new_tokens=n), want)
    # The cache counts padded columns (what generate slices by), the state holds live tokens.
    assert cache.get_seq_length() == P + n - 1
    assert torch.equal(cache.live_counts, mask.sum(1) + n - 1)


def test_left_padding_is_a_no_op():
    """A left-padded row generates exactly what it generates alone and unpadded."""
    model = random_model(11)
    ids = random_ids(model.config, 3, 9, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    for b in range(3):
        alone = model.generate(ids[b:b + 1, mask[b].bool()], max_new_tokens=7, do_sample=False)
        assert torch.equal(_new(out, 9)[b], _new(alone, int(mask[b].sum()))[0])


def test_eos_pad_and_max_new_tokens_match_static_decoder():
    model = random_model(12)
    ids = random_ids(model.config, 2, 6, seed=2)
    free = _new(model.generate(ids, max_new_tokens=10, do_sample=False), 6)
    eos = int(free[0, 3])  # row 0 stops at its 4th new token (or earlier if it came before)
    stop = int((free[0] == eos).nonzero()[0])
    pad = (eos + 1) % model.config.vocab_size
    # An explicit mask: given a pad id, generate() would otherwise infer padding from the ids.
    out = _new(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                              eos_token_id=eos, pad_token_id=pad), 6)
    assert torch.equal(out[0, :stop + 1], free[0, :stop + 1])
    assert (out[0, stop + 1:] == pad).all()
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    ref = dec.generate(ids, max_new_tokens=10, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(out, ref[:, :out.shape[1]])
    assert out.shape[1] <= 10


def test_logits_processors_and_scores_match_uncached():
    """repetition_penalty / no_repeat_ngram / min_new_tokens act on the cached logits exactly as
    on the uncached ones; return_dict_in_generate carries the per-step scores and the cache."""
    model = random_model(13)
    ids = random_ids(model.config, 2, 7, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, repetition_penalty=1.7,
              no_repeat_ngram_size=2, return_dict_in_generate=True, output_scores=True)
    a = model.generate(ids, **kw)
    b = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores) == a.sequences.shape[1] - 7
    for sa, sb in zip(a.scores, b.scores):
        fin = torch.isfinite(sb)
        assert torch.equal(torch.isfinite(sa), fin)
        torch.testing.assert_close(sa[fin], sb[fin], atol=1e-4, rtol=1e-4)
    assert isinstance(a.cache, ShramCache)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not torch.equal(plain, a.sequences)  # the processors changed something


def test_sampling_is_seeded_and_respects_filters():
    model = random_model(14)
    ids = random_ids(model.config, 2, 5, seed=4)
    kw = dict(max_new_tokens=10, do_sample=True, top_k=3, top_p=0.9, temperature=0.8)
    torch.manual_seed(123)
    a = model.generate(ids, **kw)
    torch.manual_seed(123)
    b = model.generate(ids, **kw)
    assert torch.equal(a, b)
    # Independent check with the uncached forward: every sampled token is among the 3 most
    # likely of its step.
    logits = model(a[:, :-1]).logits  # (B, N-1, V)
    for t in range(5, a.shape[1]):
        top3 = logits[:, t - 1].topk(3).indices  # (B, 3)
        assert (top3 == a[:, t, None]).any(-1).all(), t


def test_beam_search_matches_uncached():
    model = random_model(15)
    ids = random_ids(model.config, 2, 6, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False,
              return_dict_in_generate=True, output_scores=True, length_penalty=1.0)
    a = model.generate(ids, **kw)
    b = model.generate(ids, use_cache=False, **kw)
    assert a.sequences.shape[0] == 4
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(a.sequences_scores, b.sequences_scores, atol=1e-4, rtol=0)
    assert a.cache.batch_size == 6  # 2 prompts x 3 beams


def test_beam_sampling_and_several_samples_per_prompt():
    model = random_model(23)
    ids = random_ids(model.config, 2, 5, seed=17)
    torch.manual_seed(0)
    out = model.generate(ids, num_beams=2, do_sample=True, top_k=4, max_new_tokens=5)
    assert out.shape == (2, 10) and torch.equal(out[:, :5], ids)
    out = model.generate(ids, do_sample=True, num_return_sequences=3, max_new_tokens=5,
                         return_dict_in_generate=True)
    assert out.sequences.shape == (6, 10) and out.cache.batch_size == 6
    assert torch.equal(out.sequences[:, :5], ids.repeat_interleave(3, 0))


def test_reorder_cache_in_place():
    model = random_model(16)
    cache = ShramCache(model.config, 3, prefill_chunk=4)
    model(random_ids(model.config, 3, 6, seed=6), cache=cache)
    before = [t.clone() for t in cache.state.tensors()]
    ptrs = [t.data_ptr() for t in cache.state.tensors()]
    counts = cache.live_counts.clone()
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    for old, new, p in zip(before, cache.state.tensors(), ptrs):
        assert new.data_ptr() == p
        assert torch.equal(new.view(3, -1), old.view(3, -1)[idx])
    assert torch.equal(cache.live_counts, counts[idx])


def test_user_cache_continues_across_calls():
    model = random_model(17)
    ids = random_ids(model.config, 2, 5, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    cache = ShramCache(model.config, 2, prefill_chunk=4)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache=cache)
    assert cache.get_seq_length() == first.shape[1] - 1  # the last token is not fed back yet
    more = random_ids(model.config, 2, 3, seed=8)
    ids2 = torch.cat([first, more], 1)
    mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - 5, dtype=mask.dtype)], 1)
    second = model.generate(ids2, attention_mask=mask2, max_new_tokens=5, do_sample=False, cache=cache)
    fresh = model.generate(ids2, attention_mask=mask2, max_new_tokens=5, do_sample=False)
    assert torch.equal(second, fresh)


def test_cached_forward_matches_uncached_logits():
    model = random_model(18)
    ids = random_ids(model.config, 2, 11, seed=9)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = model(ids, attention_mask=mask).logits
    cache = ShramCache(model.config, 2, prefill_chunk=4)
    parts = [model(ids[:, :7], attention_mask=mask[:, :7], cache=cache).logits]
    parts += [model(ids[:, t:t + 1], attention_mask=mask[:, t:t + 1], cache=cache).logits for t in range(7, 11)]
    got = torch.cat(parts, 1)
    live = mask.bool()
    torch.testing.assert_close(got[live], ref[live], atol=1e-4, rtol=1e-4)


def test_logits_to_keep_keeps_the_last_columns(monkeypatch):
    """transformers' `logits_to_keep`: uncached and cached (chunks before the kept columns keep
    none) equal the full forward's last k columns; generate() asks for 1 on the prompt; a bad
    value raises before the cache changes."""
    model = random_model(18)
    ids = random_ids(model.config, 2, 11, seed=9)
    full = model(ids).logits
    for k in (1, 3, 5, 8, 11, 20):
        want = full[:, -k:]
        torch.testing.assert_close(model(ids, logits_to_keep=k).logits, want, atol=1e-5, rtol=1e-5)
        cache = ShramCache(model.config, 2, prefill_chunk=4)
        got = model(ids, cache=cache, logits_to_keep=k).logits
        assert got.shape == want.shape, k
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert cache.live_counts.tolist() == [11, 11]
    # the two chunks before the kept column run the lm_head for one token per row, not 4
    flops = []
    for k in (0, 1):
        with FlopCounterMode(display=False) as fc:
            model(ids, cache=ShramCache(model.config, 2, prefill_chunk=4), logits_to_keep=k)
        flops.append(fc.get_total_flops())
    cfg = model.config
    assert flops[0] - flops[1] == 2 * (2 * 4 - 2) * cfg.embedding_width * cfg.vocab_size * 2
    snap = _snapshot(cache)
    for bad, err in ((-1, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(err, match="logits_to_keep"):
            model(ids[:, :1], cache=cache, logits_to_keep=bad)
    assert _unchanged(cache, snap)
    seen = []
    run = ShramCache.run
    monkeypatch.setattr(ShramCache, "run", lambda self, m, i, live, keep=0: seen.append((i.shape[1], keep))
                        or run(self, m, i, live, keep))
    model.generate(ids, max_new_tokens=3, do_sample=False)
    assert seen == [(11, 1), (1, 1), (1, 1)]


def _snapshot(cache):
    return [t.clone() for t in cache.state.tensors()] + [cache.live_counts.clone(), cache.columns.clone()]


def _unchanged(cache, snap):
    return all(torch.equal(a, b) for a, b in zip(snap, _snapshot(cache)))


def test_capacity_error_up_front_with_cache_unchanged():
    model = random_model(19, training_sequence_length=16, inference_sequence_length=16)
    ids = random_ids(model.config, 2, 6, seed=10)
    cache = ShramCache(model.config, 2, prefill_chunk=4)
    first = model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache)  # holds 8 per row
    snap = _snapshot(cache)
    ids2 = torch.cat([first, ids[:, :2]], 1)  # 11 columns, all live once fed
    with pytest.raises(CapacityError, match="capacity of 16"):
        model.generate(ids2, max_new_tokens=7, do_sample=False, cache=cache)  # 11 + 6 > 16
    assert _unchanged(cache, snap)
    out = model.generate(ids2, max_new_tokens=6, do_sample=False, cache=cache)  # 11 + 5 = 16 fits
    assert out.shape[1] == 11 + 6
    # A fresh generate, cached or not: prompt 6 + 11 - 1 > 16; 6 + 10 - 1 fits.
    for use_cache in (True, False):
        with pytest.raises(CapacityError):
            model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=use_cache)
    # Dead tokens do not count: a row with 4 padding columns holds 6 + 12 - 1 = 17 - 4 live.
    padded = torch.cat([torch.zeros(2, 4, dtype=ids.dtype), ids], 1)
    mask = torch.cat([torch.zeros(2, 4, dtype=torch.long), torch.ones_like(ids)], 1)
    assert model.generate(padded, attention_mask=mask, max_new_tokens=11, do_sample=False).shape[1] == 21
    # Beam search checks the same limit.
    with pytest.raises(CapacityError):
        model.generate(ids, max_new_tokens=12, num_beams=2, do_sample=False)


def test_eager_cached_forward_rejects_bad_input_with_cache_unchanged():
    model = random_model(20, training_sequence_length=16, inference_sequence_length=16)
    cache = ShramCache(model.config, 1, prefill_chunk=4)
    model(random_ids(model.config, 1, 10, seed=11), cache=cache)
    snap = _snapshot(cache)
    with pytest.raises(CapacityError):
        model(random_ids(model.config, 1, 7, seed=12), cache=cache)
    with pytest.raises(ValueError, match="vocabulary"):
        model(torch.tensor([[model.config.vocab_size]]), cache=cache)
    with pytest.raises(ValueError, match="shape"):
        model(random_ids(model.config, 2, 1, seed=13), cache=cache)
    with pytest.raises(ValueError, match="output_routing"):
        model(random_ids(model.config, 1, 1, seed=13), cache=cache, output_routing=True)
    assert _unchanged(cache, snap)


def test_prompt_lookup_and_assisted_generation_equal_uncached_greedy():
    """transformers' prompt-lookup and assisted decoding (a smaller SHRAM draft, same vocabulary)
    crop the ShramCache after rejected drafts; their tokens are the uncached greedy ones."""
    model = random_model(21, training_sequence_length=64, inference_sequence_length=64)
    draft = random_model(23, vocab_size=model.config.vocab_size, num_decoder_layers=1,
                         training_sequence_length=64, inference_sequence_length=64)
    ids = random_ids(model.config, 1, 12, seed=14)
    ids = torch.cat([ids, ids[:, :5]], 1)  # the opening again: prompt lookup finds matches
    want = model.generate(ids, max_new_tokens=24, do_sample=False, use_cache=False)
    cache = ShramCache(model.config, 1, prefill_chunk=4, rollback_limit=6)
    got = model.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=5, cache=cache)
    assert torch.equal(got, want)
    assert int(cache.live_counts) == want.shape[1] - 1  # the last token is never fed
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft), want)


def test_foreign_caches_and_bad_crops_rejected_up_front():
    model = random_model(21)
    ids = random_ids(model.config, 1, 6, seed=14)
    cache = ShramCache(model.config, 1, prefill_chunk=4)
    with pytest.raises(ValueError, match="ShramCache"):
        model.generate(ids, max_new_tokens=4, cache=DynamicCache())
    with pytest.raises(ValueError, match="batch_size=1"):
        model.generate(ids.repeat(2, 1), max_new_tokens=4, cache=cache)
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids, max_new_tokens=4, cache_implementation="static")
    with pytest.raises(ValueError, match="cannot crop 1 tokens"):
        cache.crop(-1)  # nothing fed yet
    model(ids, cache=cache)
    snap = _snapshot(cache)
    for n, words in ((-5, "at most 4"), (2, "negative")):
        with pytest.raises(ValueError, match=words):
            cache.crop(n)
    assert _unchanged(cache, snap)
    cache.crop(-4)
    assert int(cache.live_counts) == 2 and cache.get_seq_length() == 2


# -- compiled generate: one tiny model compiled once for the tests below ------------------

@pytest.fixture(scope="module")
def compiled():
    """(model whose generate() compiles its decode forward on CPU, prompt, mask); warmed up."""
    model = random_model(22, num_decoder_layers=1)
    model.generation_config.compile_config._compile_all_devices = True  # the documented CPU line
    ids = random_ids(model.config, 2, 6, seed=15)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with recorded_builds() as batches:
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)  # compiles
    yield model, ids, mask, batches
    torch.compiler.set_stance("default")


def test_compiled_generate_never_recompiles_and_matches_eager(compiled):
    model, ids, mask, _ = compiled
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, disable_compile=True)
    eager_nomask = model.generate(ids, max_new_tokens=8, do_sample=False, disable_compile=True)
    torch.compiler.set_stance("fail_on_recompile")
    try:
        # a whole generation, twice with the same shapes, with and without a mask
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), eager)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), eager_nomask)
        cache = ShramCache(model.config, 2)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                          cache=cache), eager)
    finally:
        torch.compiler.set_stance("default")
    assert model._compiled_call is not None  # the decode forward really ran compiled


def test_compiled_generate_builds_its_kernels_a_few_files_at_a_time(compiled):
    """generate()'s compiled forward builds its graph's C++ kernels as at most compile_threads
    files (accelerators/kernel_builds.py), not one g++ run per kernel."""
    model, _, _, batches = compiled
    assert model.get_compiled_call(model.generation_config.compile_config) is \
        model.get_compiled_call(model.generation_config.compile_config)  # one wrapper, kept
    if get_compile_threads() > 1 and enabled("batched_kernel_builds"):
        assert len(batches) == 1  # one graph, its kernels built together
        for kernels in batches:
            assert len({id(k.__self__) for k in kernels}) <= get_compile_threads() < len(kernels)
    else:  # one compile thread, or the accelerator off: Inductor's own builds
        assert batches == []


def test_compiled_sampling_equals_eager_sampling(compiled):
    model, ids, mask, _ = compiled
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=5, temperature=0.9)
    torch.manual_seed(5)
    eager = model.generate(ids, disable_compile=True, **kw)
    torch.compiler.set_stance("fail_on_recompile")
    try:
        torch.manual_seed(5)
        got = model.generate(ids, **kw)
    finally:
        torch.compiler.set_stance("default")
    assert torch.equal(got, eager)
