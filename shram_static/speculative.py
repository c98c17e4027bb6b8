"""Speculative decoding on any `HostDecoder` (eager, compiled, `.pte`, `.onnx`): drafts,
verification in one fixed-shape step, acceptance, and rollback of the rejected tail.

Each round feeds every row its last token plus up to k guessed tokens through the verify step
(`HostDecoder.verify`), keeps the guesses the target model agrees with, and forgets the rest
(`HostDecoder.rollback`). Guesses come from
- prompt lookup (`PromptLookup`): the tokens that followed the latest earlier occurrence of the
  row's last n-gram in its prompt and output so far (transformers' `prompt_lookup_num_tokens`);
- a draft decoder: any smaller SHRAM model with the same vocabulary, run greedily or sampled
  for k steps and rolled back in lockstep with the target.
Greedy acceptance keeps the guesses equal to the target's argmax, so the tokens are exactly
plain greedy decoding's. Sampling uses the speculative-sampling rule (Leviathan et al. 2023):
guess x from q is kept with probability min(1, p(x) / q(x)), a rejected one is replaced by a
sample of norm(max(p - q, 0)); a prompt-lookup guess has q = one-hot, so it is kept with
probability p(x) and replaced from p without x. Either way the output is distributed as the
target model's samples.

k adapts as it goes: prompt lookup verifies only while the guesses it made recently paid for a
verify step (`VERIFY_COST` decode steps), probing now and then; a draft decoder drafts one more
token after a fully accepted round and one fewer after a rejection (transformers' heuristic).
"""

import contextlib

import torch

from .sampling import draw

# What a verify step of up to 5 tokens costs, in decode steps, for the gate that decides whether
# prompt-lookup guesses are worth verifying: a round must keep VERIFY_COST - 1 guesses on
# average to beat plain decoding. A constant, not a timing, so that seeded sampling stays
# reproducible; `shram-static bench-speculative` measures the ratio (docs/performance.md, "Speculative decoding").
VERIFY_COST = 1.5
PROBE_EVERY = 2  # a gated-off prompt lookup still verifies one round in this many
# The n-grams prompt lookup matches: the longest match up to LOOKUP_NGRAMS[0] tokens, none
# shorter than LOOKUP_NGRAMS[1]. WHY these and PROBE_EVERY: replaying greedy decoding of the
# built-in model on 8 prompts (`benchmarks/prompt_lookup.py`), (8, 2) with a probe every 2nd
# gated-off round needs fewer steps than (3, 1) every 8th on every prompt, grounded and free
# (docs/speculative.md): a longer match picks the right
# earlier occurrence, and a one-token match (a byte, a common word) guesses no better than
# chance, costing a verify step.
LOOKUP_NGRAMS = (8, 2)


class PromptLookup:
    """n-gram drafts from a row's own tokens (ids below 0x110000: one character each).

    Args:
        max_ngram: the longest n-gram matched; shorter ones are tried down to `min_ngram`.
        min_ngram: the shortest n-gram matched.
    """

    def __init__(self, max_ngram: int, min_ngram: int):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        # WHY the tokens as a str, one character each: `str.rfind` finds the latest earlier
        # occurrence of an n-gram in C, where an index of every n-gram, kept up in Python token
        # by token, was a visible share of a speculative round's host time
        self._text = ""

    def extend(self, tokens) -> None:
        self._text += "".join(map(chr, map(int, tokens)))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        n-gram at the end of the sequence ([] when none matches)."""
        text = self._text
        end = len(text)
        if k < 1:
            return []
        for n in self.sizes:
            if end <= n:  # the tail is the whole sequence: no earlier occurrence
                continue
            i = text.rfind(text[end - n:], 0, end - 1)  # an occurrence ending before `end`
            if i >= 0:
                return [ord(c) for c in text[i + n:i + n + k]]
        return []


def _pick(logits: torch.Tensor, warp, sample: bool, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token, probabilities or None) from (V,) logits: argmax, or a sample of the `Sampler`
    warp's distribution."""
    if not sample:
        return logits.argmax(-1), None
    p = warp.probs(logits)
    return draw(p, gen), p


def _accept(logits: torch.Tensor, drafts: list[int], q: list | None, warp, sample: bool, gen) -> list[int]:
    """The tokens one verified row emits: the accepted guesses, then the target's own token.

    Args:
        logits: (n+1, V) target logits after the last token and after each of the n guesses.
        drafts: the n guesses.
        q: the draft's (V,) probabilities per guess (sampling with a draft decoder), else None.
        warp: the `sampling.Sampler` of the request.
    """
    out: list[int] = []
    if not sample:  # the guesses equal to the argmax, then the argmax after them
        top = logits.argmax(-1).tolist()
        for i, d in enumerate(drafts):
            if top[i] != d:
                return out + [top[i]]
            out.append(d)
        return out + [top[len(drafts)]]
    for i, d in enumerate(drafts):
        p = warp.probs(logits[i])
        qd = q[i] if q is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([d]), 1.0)
        if torch.rand((), generator=gen) < torch.clamp(p[d] / qd[d].clamp(min=1e-30), max=1.0):
            out.append(d)
            continue
        resid = (p - qd).clamp(min=0)
        resid = resid / resid.sum() if float(resid.sum()) > 0 else p
        return out + [int(draw(resid, gen))]
    t, _ = _pick(logits[len(drafts)], warp, sample, gen)
    return out + [int(t)]


def _feed_last(dec, toks: list[list[int]]) -> torch.Tensor:
    """Feeds each row its list of tokens (0, 1 or more) in one step; (B, V) logits at each row's
    last fed token (unspecified for a row fed nothing)."""
    n = max(max(len(t) for t in toks), 1)
    ids = torch.tensor([t + [0] * (n - len(t)) for t in toks])
    live = torch.tensor([[j < len(t) for j in range(n)] for t in toks])
    if n > 1 and n > (dec.verify_len or 0):  # a prefill: its last-token logits only
        return dec.prefill(ids, live, last_only=True)
    lg = _step(dec, ids, live)
    last = torch.tensor([max(len(t) - 1, 0) for t in toks])
    return lg[torch.arange(dec.batch_size), last]


def _step(dec, ids: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Feeds tokens this loop picked, ids (B, n) with live (B, n), in one step: (B, n, V) logits.
    `HostDecoder.feed` skips the public methods' input checks (ids from the model's own
    logits, capacity checked by `generate`); more tokens than a verify step takes go to prefill."""
    if ids.shape[1] == 1 or ids.shape[1] <= (dec.verify_len or 0):
        return dec.feed(ids, live)
    return dec.prefill(ids, live)


def steady(decoders, on: bool = True) -> contextlib.ExitStack:
    """Enters `d.steady(on)` of each decoder that has one (`StaticDecoder`): within it, the
    caller runs none of its user's code between steps, so a compiled decoder checks its packed
    weights once per kind of step. Other decoders need no such window.

    Args:
        decoders: `HostDecoder`s (None entries are skipped).
        on: False gives a window that changes nothing (a streamer runs between steps).

    Returns:
        The entered `ExitStack` (a context manager that leaves every window).
    """
    stack = contextlib.ExitStack()
    for d in decoders:
        if d is not None and hasattr(d, "steady"):
            stack.enter_context(d.steady(on))
    return stack


def speculative_generate(dec, ids: torch.Tensor, live: torch.Tensor, max_new_tokens: int, sample: bool, warp,
                         gen, eos: int | None, pad: int, streamer, speculate: int, draft=None,
                         stats: dict | None = None) -> torch.Tensor:
    """`HostDecoder.generate` with speculation (arguments already validated there).

    Args:
        dec: the target `HostDecoder`.
        ids, live: (B, N) prompt and its live mask.
        sample, warp, gen: sample (else greedy) with the `sampling.Sampler` warp and the
            generator gen.
        speculate: k, the most guesses per row and round.
        draft: a `HostDecoder` with the same batch size and vocabulary, or None (prompt lookup).
        stats: if a dict, gets "rounds" (verify steps), "decodes" (plain decode steps),
            "accepted" (guesses kept), "proposed" (guesses verified) and "k" (k of each round).

    Returns:
        (B, max_new_tokens) int64 new tokens.
    """
    # Without a streamer none of the caller's code runs between steps: each decoder checks
    # each kind of step once (`steady`); a streamer's `put` may change anything.
    with steady([dec, draft], streamer is None):
        return _speculate(dec, ids, live, max_new_tokens, sample, warp, gen, eos, pad, streamer, speculate,
                          draft, stats)


def _speculate(dec, ids, live, max_new_tokens, sample, warp, gen, eos, pad, streamer, speculate, draft,
               stats) -> torch.Tensor:
    """`speculative_generate`'s loop, inside its decoders' `steady` windows."""
    B = dec.batch_size
    kmax = min(speculate, (dec.verify_len or dec.prefill_chunk) - 1, dec.rollback_limit)
    if draft is not None:
        kmax = min(kmax, draft.rollback_limit)
    st = stats if stats is not None else {}
    st.update(rounds=0, decodes=0, accepted=0, proposed=0, k=[])
    dec.reset()
    logits = dec.prefill(ids, live, last_only=True)  # (B, V)
    if draft is not None:
        draft.reset()
        draft.prefill(ids, live, last_only=True)
    # WHY Python lists, not the output tensor, until the end: a round appends ~2 tokens per row
    # and reads the last one back, and each tensor element read or write costs microseconds, a
    # visible share of what a round of a small model's speculation costs.
    rows: list[list[int]] = [[] for _ in range(B)]  # tokens produced per row
    done = [False] * B
    lookups = []
    for b in range(B):
        lk = PromptLookup(*LOOKUP_NGRAMS)
        lk.extend(ids[b][live[b]].tolist())
        lookups.append(lk)
    pending: list[list[int]] = [[] for _ in range(B)]  # tokens the draft has not been fed yet
    streamed = 0
    if streamer is not None:
        streamer.put(ids)

    def emit(b: int, toks: list[int]) -> None:
        """Appends a row's new tokens, up to its EOS or max_new_tokens."""
        for i, t in enumerate(toks):
            rows[b].append(t)
            if (eos is not None and t == eos) or len(rows[b]) == max_new_tokens:
                done[b] = True
                toks = toks[:i + 1]
                break
        lookups[b].extend(toks)

    def stream(upto: int) -> None:
        nonlocal streamed
        while streamed < upto:
            streamer.put(torch.tensor([r[streamed] if streamed < len(r) else pad for r in rows]))
            streamed += 1

    for b in range(B):
        t, _ = _pick(logits[b], warp, sample, gen)  # nothing produced yet
        emit(b, [int(t)])
        pending[b] = [int(t)]
    k = kmax  # draft decoder: adapted per round
    gain, skipped = 1.0, 0  # prompt lookup: recent guesses kept per verify step; rounds gated off
    all_live = torch.ones(B, 1, dtype=torch.bool)  # a decode step's live mask while no row is done
    while not all(done):
        if streamer is not None:
            stream(min(max_new_tokens if done[b] else len(rows[b]) for b in range(B)))
        nxt = [rows[b][-1] for b in range(B)]
        room = [0 if done[b] else min(k, max_new_tokens - len(rows[b]) - 1) for b in range(B)]
        drafts: list[list[int]] = [[] for _ in range(B)]
        q: list[list] = [[] for _ in range(B)]
        if draft is not None and max(room) > 0:
            # Row b's draft is fed its pending tokens, then its first room[b] - 1 guesses.
            feed = [pending[b] if not done[b] else [] for b in range(B)]
            for i in range(max(room)):
                dl = _feed_last(draft, feed)  # (B, V)
                for b in range(B):
                    if i < room[b]:
                        t, p = _pick(dl[b], warp, sample, gen)
                        drafts[b].append(int(t))
                        q[b].append(p)
                feed = [[drafts[b][-1]] if i + 1 < room[b] else [] for b in range(B)]
        elif draft is None:
            gate = gain + 1 >= VERIFY_COST or skipped + 1 >= PROBE_EVERY
            if gate:
                drafts = [lookups[b].propose(room[b]) if room[b] > 0 else [] for b in range(B)]
            skipped = 0 if gate else skipped + 1
        if not any(drafts):
            dlive = torch.tensor([[not d] for d in done]) if any(done) else all_live
            logits = _step(dec, torch.tensor([[t] for t in nxt]), dlive)[:, 0]
            st["decodes"] += 1
            for b in range(B):
                if not done[b]:
                    t, _ = _pick(logits[b], warp, sample, gen)
                    emit(b, [int(t)])
                    pending[b].append(int(t))  # the draft was not fed this round
            continue
        n = 1 + max(len(d) for d in drafts)
        # the verify step's own width (dead tokens after each row's guesses): no padding later
        w = dec.verify_len if n <= (dec.verify_len or 0) else n
        vids = torch.tensor([[nxt[b]] + drafts[b] + [0] * (w - 1 - len(drafts[b])) for b in range(B)])
        vlive = torch.tensor([[not done[b] and j <= len(drafts[b]) for j in range(w)] for b in range(B)])
        vl = _step(dec, vids, vlive)  # (B, w, V)
        st["rounds"] += 1
        st["k"].append(n - 1)
        back, draft_back = [0] * B, [0] * B
        kept_all = True
        for b in range(B):
            if done[b]:
                continue
            d = drafts[b]
            toks = _accept(vl[b, :len(d) + 1], d, q[b] if draft is not None and sample else None, warp,
                           sample, gen)
            a = len(toks) - 1  # guesses kept
            st["accepted"] += a
            st["proposed"] += len(d)
            kept_all &= a == len(d)
            back[b] = len(d) - a
            if draft is not None:
                fed = max(room[b] - 1, 0)  # guesses the draft was fed
                draft_back[b] = fed - min(a, fed)
                pending[b] = toks[min(a, fed):]
            emit(b, toks)
        # each row forgets no more than the guesses it was just fed (<= k <= rollback_limit)
        if any(back):
            dec.forget(torch.tensor(back))
        if draft is not None:
            if any(draft_back):
                draft.forget(torch.tensor(draft_back))
            k = min(kmax, k + 2) if kept_all else max(1, k - 1)
        else:
            tried = [b for b in range(B) if drafts[b]]
            gain = 0.5 * gain + 0.5 * sum(len(drafts[b]) - back[b] for b in tried) / len(tried)
    if streamer is not None:
        stream(max(len(r) for r in rows))
        streamer.end()
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long)
    for b in range(B):
        out[b, :len(rows[b])] = torch.tensor(rows[b], dtype=torch.long)
    return out
