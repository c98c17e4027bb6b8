"""Speculative generation: greedy tokens equal plain greedy decoding's (golden tokens of the
original code, prompt lookup and a draft decoder, padding and EOS), the acceptance rule leaves
the target's distribution unchanged, prompt lookup finds what a plain n-gram search finds, and
bad arguments raise before anything runs."""

import os
import time

import pytest
import torch

from helpers import DATA, golden_case, load_benchmark, random_ids, random_model, tiny_model
from shram_static import StaticDecoder
from shram_static.cli import main
from shram_static.sampling import Sampler
from shram_static.bench.speculative import timed_feeds
from shram_static.speculative import LOOKUP_NGRAMS, PromptLookup, _accept, speculative_generate


@pytest.fixture(scope="module")
def pair():
    """(target, draft) random models with one vocabulary; a prompt whose opening repeats."""
    model = random_model(31, training_sequence_length=64, inference_sequence_length=64)
    draft = random_model(32, vocab_size=model.config.vocab_size, num_decoder_layers=1,
                         training_sequence_length=64, inference_sequence_length=64)
    ids = random_ids(model.config, 2, 14, seed=31)
    ids = torch.cat([ids, ids[:, :6]], 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    return model, draft, ids, mask


def test_golden_greedy_tokens_with_prompt_lookup():
    model, g = golden_case("main_basic")
    P = int(g["prompt_len"])
    dec = StaticDecoder(model, batch_size=g["input_ids"].shape[0], prefill_chunk=5)
    n = g["greedy_tokens"].shape[1]
    got = dec.generate(g["input_ids"][:, :P], g["attention_mask"][:, :P], max_new_tokens=n, speculate=3)
    assert torch.equal(got, g["greedy_tokens"])


@pytest.mark.parametrize("source", ["lookup", "draft", "self_draft"])
def test_speculative_greedy_equals_greedy(pair, source):
    """Prompt lookup, a smaller draft, and the target as its own draft (every guess accepted);
    rows stop at EOS at different rounds; both give plain greedy's tokens."""
    model, draft_model, ids, mask = pair
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    want = dec.generate(ids, mask, max_new_tokens=30)
    eos = int(want[0, 17])
    want_eos = dec.generate(ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=1)
    draft = {"lookup": None, "draft": StaticDecoder(draft_model, batch_size=2, prefill_chunk=3, verify_len=3),
             "self_draft": StaticDecoder(model, batch_size=2, prefill_chunk=4)}[source]
    with timed_feeds(dec) as feeds:  # (tokens per row, seconds) of each step fed
        assert torch.equal(dec.generate(ids, mask, max_new_tokens=30, speculate=4, draft=draft), want)
    calls = [n for n, _ in feeds if n > 1]  # the verify steps
    assert len(calls) >= 3 if source != "self_draft" else len(calls) <= 30 // 4 + 2
    plain_puts, spec_puts = Recorder(), Recorder()
    dec.generate(ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=1, streamer=plain_puts)
    got = dec.generate(ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=1, speculate=4, draft=draft,
                       streamer=spec_puts)
    assert torch.equal(got, want_eos)
    # streamed: the prompt, then one (B,) column per position (pad after a row's EOS), then end
    assert spec_puts.ended and plain_puts.ended
    assert torch.equal(spec_puts.values[0], ids) and len(spec_puts.values) == len(plain_puts.values)
    assert torch.equal(torch.stack(spec_puts.values[1:], 1), torch.stack(plain_puts.values[1:], 1))


class Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.values, self.ended = [], False

    def put(self, value):
        self.values.append(value.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("source", ["plain", "lookup", "draft"])
def test_generation_checks_the_prompt_not_each_step(pair, monkeypatch, source):
    """`generate`'s loops feed the tokens they pick through `feed`, without the public methods'
    input checks: the ids are checked as often for 6 new tokens as for 24 (the prompt only).
    A loop that went back to `decode` / `verify` / `rollback` would check once per step."""
    from shram_static import host, validation

    model, draft_model, ids, mask = pair
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    draft = StaticDecoder(draft_model, batch_size=2, prefill_chunk=3, verify_len=3) if source == "draft" else None
    kw = {} if source == "plain" else dict(speculate=4, draft=draft)
    calls = []
    for mod in (host, validation):
        real = mod.check_input_ids
        monkeypatch.setattr(mod, "check_input_ids", lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    monkeypatch.setattr(StaticDecoder, "rollback", lambda *a: pytest.fail("generate called rollback"))
    counts = []
    for n in (6, 24):
        calls.clear()
        dec.generate(ids, mask, max_new_tokens=n, **kw)
        counts.append(len(calls))
    assert counts[0] == counts[1] and counts[0] >= 1, counts


def test_acceptance_rule_keeps_the_target_distribution():
    """Speculative sampling's first token is distributed as p, with a sampled draft (q) and with
    a deterministic guess (prompt lookup); greedy keeps the argmax prefix."""
    gen = torch.Generator().manual_seed(0)
    V, n = 5, 6000
    logits = torch.randn(2, V, generator=gen) * 1.5
    p = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.randn(V, generator=gen), -1)
    plain = Sampler()  # temperature 1, no filters: the target distribution is softmax(logits)
    for guess, qq in (("draft", q), ("lookup", None)):
        counts = torch.zeros(V)
        for _ in range(n):
            d = int(torch.multinomial(q, 1, generator=gen)) if qq is not None else 3
            counts[_accept(logits, [d], [qq] if qq is not None else None, plain, True, gen)[0]] += 1
        assert (counts / n - p).abs().max() < 0.025, guess
    top = int(logits[0].argmax())
    assert _accept(logits, [top], None, plain, False, None) == [top, int(logits[1].argmax())]
    assert _accept(logits, [(top + 1) % V], None, plain, False, None) == [top]


# token ids: a few small ones, and large ones whose characters are surrogates or past the BMP
@pytest.mark.parametrize("alphabet", [[0, 1, 2, 3], [0, 0xD800, 0xDFFF, 0x10FFFF]])
@pytest.mark.parametrize("sizes", [(3, 1), (8, 2), None])  # None: the package's LOOKUP_NGRAMS
def test_prompt_lookup_matches_a_plain_search(sizes, alphabet):
    gen = torch.Generator().manual_seed(1)
    seq = [alphabet[i] for i in torch.randint(0, 4, (200,), generator=gen).tolist()]
    lk = PromptLookup(*(sizes or LOOKUP_NGRAMS))
    mx, mn = sizes or (8, 2)
    for i, t in enumerate(seq):
        lk.extend([t])
        s = seq[:i + 1]
        want = []
        for n in range(mx, mn - 1, -1):  # latest earlier occurrence of the longest matching tail
            hits = [j for j in range(len(s) - n) if s[j:j + n] == s[-n:]]
            if len(s) > n and hits:
                want = s[hits[-1] + n:hits[-1] + n + 4]
                break
        assert lk.propose(4) == want


def test_bad_speculation_arguments_raise_first(pair):
    model, draft_model, ids, mask = pair
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    dec.prefill(ids[:, :3])
    before = dec.live_counts
    wrong_batch = StaticDecoder(draft_model, batch_size=1, prefill_chunk=4)
    for kw, words in (({"speculate": 0}, "positive"), ({"speculate": 2.0}, "positive"),
                      ({"draft": wrong_batch}, "batch_size"), ({"draft": "m"}, "HostDecoder")):
        with pytest.raises(ValueError, match=words):
            dec.generate(ids, mask, max_new_tokens=4, **kw)
    assert torch.equal(dec.live_counts, before)


def test_cli_speculate_and_draft_print_the_greedy_text(capsys):
    path = os.path.join(DATA, "main_basic")
    base = ["generate", "--prompt", "The cat. The cat", "--checkpoint", path, "--max-new-tokens", "16",
            "--prefill-chunk", "4"]
    assert main(base) == 0
    want = capsys.readouterr().out
    for extra in (["--speculate", "3"], ["--draft", path]):
        assert main(base + extra) == 0
        assert capsys.readouterr().out == want


def test_bench_speculative_command_reports_both_prompts(capsys, tmp_path):
    """`shram-static bench-speculative` on a checkpoint, eager: the step costs and, per prompt,
    speculative against plain tokens/s (it raises if the speculative tokens differ)."""
    path = str(tmp_path / "ckpt")  # one layer, room for the 516-token grounded prompt
    tiny_model(num_decoder_layers=1, inference_sequence_length=640).save_pretrained(path)
    assert main(["bench-speculative", "--model", path, "--backend", "eager", "--max-new-tokens", "24",
                 "--context", "8", "--steps", "3", "--rounds", "1", "--prefill-chunk", "8"]) == 0
    out, err = capsys.readouterr()
    assert "prefill chunk 8:" in err
    assert "verify / decode = " in out and "a decode step after a decode step " in out
    assert "as generate feeds them " in out
    for name in ("grounded", "free"):
        line = next(ln for ln in out.splitlines() if ln.startswith(name))
        assert "24 new" in line and "after the first token" in line and "tokens per step" in line
        assert "inside the loops, plain: decode steps " in line and " around each" in line
    with pytest.raises(SystemExit) as e:
        main(["bench-speculative", "--model", path, "--speculate", "0"])
    assert e.value.code == 2 and "expected a positive integer, got 0" in capsys.readouterr().err


def test_bench_speculative_times_every_fed_step_and_leaves_the_decoder_as_it_was():
    """`bench.speculative.timed_feeds`, the benchmark's timer, sees each step `generate` feeds (one
    per token after the first for plain greedy; the verify and decode steps speculation
    counts), and records nothing afterwards, also when the block raises."""
    from shram_static.bench.speculative import _split
    dec = StaticDecoder(tiny_model(num_decoder_layers=1), batch_size=1, prefill_chunk=4, verify_len=4)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    with timed_feeds(dec, time.perf_counter) as feeds:
        dec.generate(ids, max_new_tokens=9)
    assert [n for n, _ in feeds] == [1] * 8 and all(s > 0 for _, s in feeds)
    st = {}
    draft = StaticDecoder(tiny_model(num_decoder_layers=1), batch_size=1, prefill_chunk=4, verify_len=4)
    with timed_feeds(dec, time.perf_counter) as feeds:  # a draft decoder guesses every round
        speculative_generate(dec, ids, torch.ones_like(ids, dtype=torch.bool), 9, False, Sampler(0),
                             None, None, 0, None, 3, draft, st)
    assert st["rounds"] > 0 and sum(n > 1 for n, _ in feeds) == st["rounds"]
    assert sum(n == 1 for n, _ in feeds) == st["decodes"]
    n = len(feeds)
    dec.generate(ids, max_new_tokens=3)
    assert len(feeds) == n  # outside the block: nothing recorded
    with pytest.raises(ZeroDivisionError), timed_feeds(dec, time.perf_counter) as inner:
        1 / 0
    dec.generate(ids, max_new_tokens=3)
    assert inner == [] and len(feeds) == n
    sp = _split([(1, 0.2), (4, 0.5), (1, 0.4)], 1.6)
    assert sp["decode"] == pytest.approx(0.3) and sp["verify"] == pytest.approx(0.5)
    assert sp["loop"] == pytest.approx(0.5 / 3)


def test_prompt_lookup_replay_counts_the_steps_of_speculative_generate():
    """`benchmarks/prompt_lookup.py` replays speculative_generate against a scripted decoder:
    it must emit the recorded tokens, and every token after the first is a kept guess or the
    one token each verify or decode step adds."""
    bench = load_benchmark("prompt_lookup")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    new = [1, 2, 3, 4, 9, 9, 5, 6, 7, 8, 1, 2] * 4
    for setting in (None, (3, 1, 8), (8, 2, 2)):
        st = bench.steps(prompt, new, 16, setting)
        assert st["accepted"] + st["rounds"] + st["decodes"] == len(new) - 1
        assert st["rounds"] > 0 and st["accepted"] > 0  # the repeats are guessed
    for k in (1, 2, 6):  # `--speculate K`: verify steps of K + 1 tokens, at most K guesses each
        st = bench.steps(prompt, new, 16, None, k)
        assert st["accepted"] + st["rounds"] + st["decodes"] == len(new) - 1
        assert max(st["k"]) == k and st["accepted"] <= k * st["rounds"]


def test_prompt_lookup_oracle_verifies_exactly_the_kept_guesses():
    """`benchmarks/prompt_lookup.py`'s bound: each round verifies only the guesses the target
    keeps, at a cost linear in the tokens, and decodes when it would keep none."""
    bench = load_benchmark("prompt_lookup")
    prompt = [1, 2, 3, 4, 5, 6]
    # (6, 1) was never seen: a decode; then (1, 2) proposes 3, 4, 5 (room 3), all kept
    assert bench.oracle_cost(prompt, [1, 2, 3, 4, 5, 7], 1.8) == pytest.approx((1 + 1 + 0.8 * 3 / 4, 1, 1))
    # the same, but only 3 is kept: a 2-token verify step, then 9 and 5 decoded
    assert bench.oracle_cost(prompt, [1, 2, 3, 9, 5, 7], 1.8) == pytest.approx((1 + (1 + 0.8 / 4) + 1 + 1, 1, 3))


def test_a_last_token_export_without_a_verify_step_refuses_to_verify(pair):
    """A decoder whose prefill step returns only the last token's logits (an export without
    `full_logits`) and that has no verify step cannot verify guesses: `verify` and speculative
    `generate` raise a ValueError naming `full_logits` before anything runs. (The checks live
    in `HostDecoder`; this eager decoder is given an export's attributes.)"""
    model, _, ids, mask = pair
    dec = StaticDecoder(model, batch_size=2, prefill_chunk=4)
    dec.prefill(ids[:, :3])
    before = dec.live_counts
    dec.full_logits, dec.verify_len = False, None
    with pytest.raises(ValueError, match="full_logits"):
        dec.verify(ids[:, 3:6])
    with pytest.raises(ValueError, match="full_logits"):
        dec.generate(ids, mask, max_new_tokens=4, speculate=2)
    assert torch.equal(dec.live_counts, before)
    assert torch.equal(dec.generate(ids, mask, max_new_tokens=4),  # plain generation still runs
                       StaticDecoder(model, batch_size=2, prefill_chunk=4).generate(ids, mask, max_new_tokens=4))
