"""Speculative decoding on any `HostDecoder` (eager, compiled, `.pte`, `.onnx`): drafts,
verification in one fixed-shape step, acceptance, and rollback of the rejected tail.

Guesses come from prompt lookup (`PromptLookup`) or a draft decoder. Greedy acceptance keeps
the guesses equal to the target's argmax; sampling uses the speculative-sampling rule (Leviathan
et al. 2023: keep x with probability min(1, p(x) / q(x)), else sample norm(max(p - q, 0)); a
prompt-lookup guess has q = one-hot). See docs/speculative.md.
"""

import contextlib

import torch

from .sampling import draw

# A verify step's cost in decode steps, for the gate on prompt-lookup guesses (a round must keep
# VERIFY_COST - 1 guesses on average to pay); a constant, not a timing, so seeded sampling reproduces.
VERIFY_COST = 1.5
PROBE_EVERY = 2  # a gated-off prompt lookup still verifies one round in this many
LOOKUP_NGRAMS = (8, 2)  # the longest and shortest n-gram prompt lookup matches (docs/speculative.md)


class PromptLookup:
    """n-gram drafts from a row's own tokens (ids below 0x110000: one character each).

    Args:
        max_ngram: the longest n-gram matched; shorter ones are tried down to `min_ngram`.
        min_ngram: the shortest n-gram matched.
    """

    def __init__(self, max_ngram: int, min_ngram: int):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        # WHY a str, one character per token: `str.rfind` finds the latest earlier n-gram in C
        self._text = ""

    def extend(self, tokens) -> None:
        self._text += "".join(map(chr, map(int, tokens)))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        n-gram at the end of the sequence ([] when none matches)."""
        text, end = self._text, len(self._text)
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
    """(token, probabilities or None) from (V,) logits: argmax, or a sample of warp's distribution."""
    if not sample:
        return logits.argmax(-1), None
    p = warp.probs(logits)
    return draw(p, gen), p


def _kept(top: list[int], drafts: list[int]) -> list[int]:
    """Greedy acceptance: the guesses equal to the argmax `top` (n+1 ids), then the argmax after them."""
    a = next((i for i, d in enumerate(drafts) if top[i] != d), len(drafts))
    return drafts[:a] + [top[a]]


def _accept(logits: torch.Tensor, drafts: list[int], q: list | None, warp, sample: bool, gen) -> list[int]:
    """The accepted guesses, then the target's own token, from logits (n+1, V) over n drafts;
    q: the draft's (V,) probabilities per guess (sampling with a draft decoder), else None."""
    if not sample:
        return _kept(logits.argmax(-1).tolist(), drafts)
    out: list[int] = []
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
    """Feeds each row its list of tokens in one step: (B, V) logits at each row's last one."""
    n = max(max(len(t) for t in toks), 1)
    ids = torch.tensor([t + [0] * (n - len(t)) for t in toks])
    live = torch.tensor([[j < len(t) for j in range(n)] for t in toks])
    if n > 1 and n > (dec.verify_len or 0):  # a prefill: its last-token logits only
        return dec.prefill(ids, live, last_only=True)
    last = torch.tensor([max(len(t) - 1, 0) for t in toks])
    return dec.feed(ids, live)[torch.arange(dec.batch_size), last]


def steady(decoders, on: bool = True) -> contextlib.ExitStack:
    """Enters `d.steady(on)` of each decoder that has one (`StaticDecoder.steady`).

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
        sample, warp, gen: sample (else greedy) with the `sampling.Sampler` and the generator.
        speculate: k, the most guesses per row and round.
        draft: a `HostDecoder` with the same batch size and vocabulary, or None (prompt lookup).
        stats: a dict gets "rounds" (verify steps), "decodes", "accepted" / "proposed" guesses, "k".

    Returns:
        (B, max_new_tokens) int64 new tokens.
    """
    with steady([dec, draft], streamer is None):  # a streamer's `put` runs the caller's code
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
        # WHY Python lists until the end: each tensor element read or write costs microseconds
        rows: list[list[int]] = [[] for _ in range(B)]  # tokens produced per row
        done = [False] * B
        lookups = [PromptLookup(*LOOKUP_NGRAMS) for _ in range(B)]
        for b in range(B):
            lookups[b].extend(ids[b][live[b]].tolist())
        streamed = 0
        if streamer is not None:
            streamer.put(ids)

        def emit(b: int, toks: list[int]) -> None:
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
        pending = [r[:] for r in rows]  # tokens the draft has not been fed yet
        k = kmax  # draft decoder: adapted per round
        gain, skipped = 1.0, 0  # prompt lookup: recent guesses kept per verify step; rounds gated off
        # WHY inputs that share numpy's memory, and numpy's argmax: each torch op the loop runs
        # right after a step costs several times its warm cost (the step evicted the host code)
        one, one_live = torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool)  # decode steps'
        vlen = dec.verify_len  # verify steps' ids and live tokens (B, vlen), where the decoder has them
        v_ids, v_live = ((torch.zeros(B, vlen, dtype=torch.long), torch.zeros(B, vlen, dtype=torch.bool))
                         if vlen else (None, None))
        back_t = torch.zeros(B, dtype=torch.long)  # each row's rejected guesses
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
                one.numpy()[:, 0] = nxt
                one_live.numpy()[:, 0] = [not d for d in done]
                lg = dec.feed(one, one_live)  # (B, 1, V)
                st["decodes"] += 1
                top = None if sample else lg.numpy()[:, 0].argmax(-1).tolist()  # the first of equal maxima
                for b in range(B):
                    if not done[b]:
                        t = int(_pick(lg[b, 0], warp, sample, gen)[0]) if sample else top[b]
                        emit(b, [t])
                        pending[b].append(t)  # the draft was not fed this round
                continue
            n = 1 + max(len(d) for d in drafts)
            # the verify step's own width (dead tokens after each row's guesses): no padding later
            w = dec.verify_len if n <= (dec.verify_len or 0) else n
            rows_in = [[nxt[b]] + drafts[b] + [0] * (w - 1 - len(drafts[b])) for b in range(B)]
            live_in = [[not done[b] and j <= len(drafts[b]) for j in range(w)] for b in range(B)]
            if w == vlen:
                v_ids.numpy()[:] = rows_in
                v_live.numpy()[:] = live_in
                vl = dec.feed(v_ids, v_live)  # (B, w, V)
            else:
                vl = dec.prefill(torch.tensor(rows_in), torch.tensor(live_in))
            top = None if sample else vl.numpy().argmax(-1).tolist()  # (B, w)
            st["rounds"] += 1
            st["k"].append(n - 1)
            back, draft_back = [0] * B, [0] * B
            kept_all = True
            for b in range(B):
                if done[b]:
                    continue
                d = drafts[b]
                toks = _accept(vl[b, :len(d) + 1], d, q[b] if draft is not None and sample else None, warp,
                               sample, gen) if sample else _kept(top[b], d)
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
                back_t.numpy()[:] = back
                dec.forget(back_t)
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
        return torch.tensor([r + [pad] * (max_new_tokens - len(r)) for r in rows], dtype=torch.long)
