"""Picking tokens from logits: greedy, or a sample under temperature, top-k and top-p.

One implementation for `HostDecoder.generate`, speculative decoding (`speculative.py`) and the
server's engine (`serve/engine.py`). The logits are scaled in float64 after the row's maximum
is subtracted, so the top logit becomes exactly 0 and every other one a finite negative number
or -inf: no temperature > 0 overflows (logits / 1e-300 in float32 is inf, and softmax of inf
is NaN). A temperature small enough that no other token keeps any probability gives greedy's
token (one of equal maxima). Top-k and top-p are transformers' logits warpers, applied after
the temperature as in `generate()`.
"""

import math

import torch
from transformers.generation.logits_process import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["Sampler", "draw"]


class Sampler:
    """One request's sampling settings.

    Args:
        temperature: 0 for greedy (argmax), else any finite value > 0.
        top_k: keep the k most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p,
            0 < top_p <= 1 (None or 1: all).

    Raises:
        TypeError, ValueError: a setting outside those ranges.
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                                  or not 0 < top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        self.temperature = float(temperature)
        self.top_k, self.top_p = top_k, top_p
        self.greedy = self.temperature == 0
        self._warp = LogitsProcessorList()
        if top_k is not None:
            self._warp.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1:
            self._warp.append(TopPLogitsWarper(float(top_p)))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution of each row of finite logits.

        Args:
            logits: (V,) or (N, V) logits, any float dtype.

        Returns:
            float64 probabilities of the same shape (each row sums to 1). Greedy: one-hot at
            the argmax.
        """
        x = logits.detach().to(torch.float64)
        if self.greedy:
            return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        x = x - x.amax(-1, keepdim=True)  # <= 0, the max exactly 0: no overflow below
        if self.temperature != 1:
            x = x / self.temperature
        if self._warp:  # transformers' warpers take (N, V) scores; these read no input ids
            x2 = x.reshape(-1, x.shape[-1])
            x = self._warp(torch.empty(x2.shape[0], 0, dtype=torch.long), x2).reshape(x.shape)
        return torch.softmax(x, dim=-1)

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Picks one token per row.

        Args:
            logits: (V,) or (N, V) finite logits.
            generator: the random source of the samples (None: torch's global one).

        Returns:
            int64 token ids, () for (V,) logits, else (N,): the argmax (the first of equal
            maxima) when greedy, else a sample of `probs`.
        """
        if self.greedy:
            return logits.argmax(-1)
        return draw(self.probs(logits), generator)


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probabilities p, (V,) or (N, V) (any non-negative weights with a
    positive sum): int64, () or (N,)."""
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).reshape(p.shape[:-1])
