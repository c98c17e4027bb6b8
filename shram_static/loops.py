"""The generation loops every decoder runs (`HostDecoder.generate`): a request's checks, then
plain or sampled decoding here, or speculative decoding (`speculative.py`). They use the decoder
contract alone (docs/design.md, "The decoder contract"), so every backend runs the same loops.
"""

import numpy as np
import torch

from .sampling import Sampler
from .speculative import speculative_generate, steady
from .validation import check_capacity


@torch.no_grad()
def generate(dec, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_token_id: int | None = None, pad_token_id: int | None = None,
             streamer=None, speculate: int | None = None, draft=None, *,
             logit_bias: dict[int, float] | None = None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """Resets, prefills the prompt, then decodes new tokens (greedy by default): `HostDecoder.generate`.

    Args:
        dec: the `HostDecoder` that runs the steps.
        input_ids, attention_mask: the prompt, as in `prefill`; every row needs a live token.
        max_new_tokens: n tokens to produce per row.
        do_sample: sample instead of argmax (also implied by temperature/top_k/top_p).
        temperature, top_k, top_p: sampling filters (`sampling.Sampler`; temperature > 0).
        seed: seeds the sampler for reproducible samples.
        eos_token_id: stops a row once produced (default: the decoder's tokenizer EOS).
        pad_token_id: fills a row after it stopped (default: eos_token_id, else 0).
        streamer: a transformers-style streamer (e.g. `TextStreamer`, batch 1): gets
            `put(prompt ids)`, then `put(tokens (B,))` as each is produced, then `end()`.
        speculate: k > 0 to decode speculatively, up to k guesses per row and round (prompt
            lookup, or `draft`); same tokens / distribution as without (`speculative.py`).
        draft: a `HostDecoder` of a smaller model with the same vocabulary and batch size that
            drafts the guesses (implies speculate=4 if speculate is None).
        logit_bias, presence_penalty, frequency_penalty, repetition_penalty: adjustments of
            each step's logits (`sampling.Sampler`); not with speculate or draft.

    Returns:
        (B, n) int64 new tokens.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # raises on a bad setting, before anything runs
    warp = Sampler(temperature, top_k, top_p, logit_bias=logit_bias, presence_penalty=presence_penalty,
                   frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                   vocab_size=dec.config.vocab_size)
    if warp.adjusts and (speculate is not None or draft is not None):
        raise ValueError("logit_bias and the penalties are not supported with speculate or draft")
    ids, live = dec.check_prompt(input_ids, attention_mask)
    n_prompt = live.long().sum(1)
    if bool((n_prompt == 0).any()):
        raise ValueError(f"every row needs at least one live prompt token; rows "
                         f"{torch.nonzero(n_prompt == 0).flatten().tolist()} have none")
    # The last new token is returned, not fed back: n_prompt + n - 1 tokens are held.
    check_capacity(n_prompt + max_new_tokens - 1, dec.capacity, " (prompt + max_new_tokens - 1)",
                   "shorten the prompt, lower max_new_tokens, or build the model with a larger "
                   "inference_sequence_length")
    eos = dec.eos_token_id if eos_token_id is None else eos_token_id
    pad = pad_token_id if pad_token_id is not None else (eos if eos is not None else 0)
    sample = do_sample or temperature != 1.0 or top_k is not None or top_p is not None
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    if speculate is not None or draft is not None:
        k = 4 if speculate is None else speculate
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculate must be a positive int, got {speculate!r}")
        if draft is not None and (not hasattr(draft, "feed") or draft.batch_size != dec.batch_size
                                  or draft.config.vocab_size != dec.config.vocab_size):
            raise ValueError("draft must be a HostDecoder with this decoder's batch_size "
                             f"({dec.batch_size}) and vocabulary ({dec.config.vocab_size} tokens)")
        if draft is not None and bool((n_prompt + max_new_tokens - 1 > draft.capacity).any()):
            raise ValueError(f"the draft decoder holds {draft.capacity} tokens per row, fewer than the "
                             f"prompt plus max_new_tokens - 1")
        for d in (dec, draft):
            if d is not None and not d.rollback_limit:
                raise ValueError(f"{type(d).__name__} cannot roll back (an export written without "
                                 f"rollback support): re-export it to decode speculatively")
        if dec.verify_len is None:  # the guesses are then verified by the prefill step
            dec.need_full_logits("speculative decoding without a verify step (exported without verify_len)")
        return speculative_generate(dec, ids, live, max_new_tokens, sample, warp, gen, eos, pad, streamer,
                                    k, draft)
    # a streamer is the caller's code between steps: every step is checked then
    with steady([dec], streamer is None):
        return _plain(dec, ids, live, max_new_tokens, sample, warp, gen, eos, pad, streamer)


def _plain(dec, ids, live, max_new_tokens: int, sample: bool, warp, gen, eos, pad, streamer) -> torch.Tensor:
    """`generate` without speculation (arguments validated there): (B, max_new_tokens) tokens."""
    dec.reset()
    logits = dec.prefill(ids, live, last_only=True).numpy()  # (B, V) float32
    # WHY numpy for the bookkeeping, and the logits read through numpy: each torch op costs
    # microseconds right after a step (docs/performance.md, "Host cost"); the tokens fed back
    # are written into two (B, 1) tensors through numpy views of them made once.
    out = np.full((dec.batch_size, max_new_tokens), pad, dtype=np.int64)
    done = np.zeros(dec.batch_size, dtype=bool)
    feed = torch.zeros(dec.batch_size, 1, dtype=torch.long)  # (B, 1) the tokens fed back
    feed_live = torch.ones(dec.batch_size, 1, dtype=torch.bool)  # (B, 1) rows still running
    feed_np, feed_live_np = feed.numpy()[:, 0], feed_live.numpy()[:, 0]  # (B,) views
    if streamer is not None:
        streamer.put(ids)
    seen = warp.history(ids, live, dec.config.vocab_size)  # None without penalties
    for t in range(max_new_tokens):
        if sample:
            nxt = warp.sample(torch.from_numpy(logits), gen, seen).numpy()
        elif warp.adjusts:
            nxt = warp.argmax(torch.from_numpy(logits), seen).numpy()
        else:
            nxt = logits.argmax(-1)  # the first of equal maxima, as torch's argmax
        if seen is not None:
            seen.add(torch.from_numpy(nxt))
        out[:, t] = np.where(done, pad, nxt)
        if streamer is not None:
            streamer.put(torch.from_numpy(out[:, t].copy()))
        if eos is not None:
            done |= nxt == eos
        if t + 1 == max_new_tokens or done.all():
            break
        feed_np[:] = np.where(done, 0, nxt)
        np.logical_not(done, out=feed_live_np)
        logits = dec.feed(feed, feed_live).numpy()[:, 0]  # (B, V): feed's logits are float32 CPU
    if streamer is not None:
        streamer.end()
    return torch.from_numpy(out)
