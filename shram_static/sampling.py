"""Picking tokens from logits: greedy, or a sample under temperature, top-k and top-p (transformers'
warpers), after OpenAI's `logit_bias`, presence and frequency penalties and vLLM's and transformers'
`repetition_penalty`, in vLLM's order (docs/serving.md); one implementation for `generate`,
speculative decoding and the server. The logits are scaled in float64 after the row's maximum is
subtracted, so no temperature > 0 overflows, and one small enough gives greedy's token.
"""

import math

import torch
from transformers.generation.logits_process import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["History", "Sampler", "draw"]

BIAS_LIMIT = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI's range of presence_penalty and frequency_penalty: [-2, 2]


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """`value` as a float in [low, high] ((low, high] when `low_open`), else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and (v > low if low_open else v >= low) and v <= high):
        raise ValueError(f"{name} must be a finite number in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return v


class History:
    """The tokens each row has seen: its prompt (for `repetition_penalty`) and how often it
    generated each token (for the frequency and presence penalties).

    Args:
        prompt: (N, P) int token ids of each row's prompt.
        live: (N, P) bool, which of them are real tokens (None: all).
        vocab_size: V, the logits' last dimension.
    """

    def __init__(self, prompt: torch.Tensor, live: torch.Tensor | None, vocab_size: int):
        prompt = torch.as_tensor(prompt, dtype=torch.long)
        prompt = prompt.reshape(-1, prompt.shape[-1])
        w = torch.ones_like(prompt) if live is None else torch.as_tensor(live).reshape(prompt.shape).long()
        self.in_prompt = torch.zeros(prompt.shape[0], vocab_size, dtype=torch.long).scatter_add_(
            1, prompt.clamp(0, vocab_size - 1), w) > 0  # (N, V)
        self.counts = torch.zeros(prompt.shape[0], vocab_size, dtype=torch.long)  # (N, V)

    def add(self, tokens: torch.Tensor) -> None:
        """Records one generated token per row: (N,) or () int ids."""
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1)
        self.counts.scatter_add_(1, t, torch.ones_like(t))


class Sampler:
    """One request's sampling settings.

    Args:
        temperature: 0 for greedy (argmax), else any finite value > 0.
        top_k: keep the k most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p,
            0 < top_p <= 1 (None or 1: all).
        logit_bias: {token id: bias}, each bias in [-100, 100], added to those logits.
        presence_penalty, frequency_penalty: in [-2, 2], OpenAI's penalties on the generated
            tokens (logit[j] -= c[j] * frequency + (c[j] > 0) * presence); they need a `History`.
        repetition_penalty: > 0 (1: off), divides positive logits and multiplies negative ones
            of every token of the prompt and the output; it needs a `History`.
        vocab_size: when given, `logit_bias` ids are checked to be below it.

    Raises:
        TypeError, ValueError: a setting outside those ranges.
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, *,
                 logit_bias: dict[int, float] | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, vocab_size: int | None = None):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                                  or not 0 < top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        self.presence_penalty = _number("presence_penalty", presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        self.frequency_penalty = _number("frequency_penalty", frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        self.repetition_penalty = _number("repetition_penalty", repetition_penalty, 0.0, math.inf, low_open=True)
        self.logit_bias = self._check_bias(logit_bias or {}, vocab_size)
        self.temperature = float(temperature)
        self.top_k, self.top_p = top_k, top_p
        self.greedy = self.temperature == 0
        self._warp = LogitsProcessorList()
        if top_k is not None:
            self._warp.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1:
            self._warp.append(TopPLogitsWarper(float(top_p)))

    @staticmethod
    def _check_bias(bias, vocab_size: int | None) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        for k in bias:
            if isinstance(k, bool) or not isinstance(k, int):
                raise TypeError(f"logit_bias keys must be int token ids, got {type(k).__name__}")
            if k < 0 or (vocab_size is not None and k >= vocab_size):
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size or 'V'}), got {k!r}")
        return {k: _number(f"logit_bias[{k}]", v, -BIAS_LIMIT, BIAS_LIMIT) for k, v in bias.items()}

    @property
    def needs_history(self) -> bool:
        """Whether a penalty is set (it reads the tokens seen: pass a `History`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts(self) -> bool:
        """Whether any logit adjustment (bias or penalty) is set."""
        return bool(self.logit_bias) or self.needs_history

    def history(self, prompt: torch.Tensor, live: torch.Tensor | None, vocab_size: int) -> "History | None":
        """A `History` of these prompts when a penalty needs one, else None (see `History`)."""
        return History(prompt, live, vocab_size) if self.needs_history else None

    def adjust(self, logits: torch.Tensor, history: History | None = None) -> torch.Tensor:
        """The logits after `logit_bias` and the penalties, float64 (the logits when none is set).

        Args:
            logits: (V,) or (N, V) logits.
            history: the tokens each row has seen (needed when a penalty is set).

        Raises:
            ValueError: a penalty is set and no history given, or a bias id >= V.
        """
        if not self.adjusts:
            return logits
        x = logits.detach().to(torch.float64).clone()
        if self.logit_bias:
            ids = torch.tensor(list(self.logit_bias), dtype=torch.long)
            if int(ids.max()) >= x.shape[-1]:
                raise ValueError(f"logit_bias holds token ids beyond the vocabulary of {x.shape[-1]}")
            x[..., ids] += torch.tensor(list(self.logit_bias.values()), dtype=torch.float64)
        if self.needs_history:
            if history is None:
                raise ValueError("presence_penalty, frequency_penalty and repetition_penalty need the "
                                 "tokens seen (a sampling.History)")
            counts = history.counts.reshape(x.shape).to(torch.float64)
            if self.repetition_penalty != 1:
                seen = history.in_prompt.reshape(x.shape) | (counts > 0)
                r = self.repetition_penalty
                x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            x = x - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).to(torch.float64)
        return x

    def probs(self, logits: torch.Tensor, history: History | None = None) -> torch.Tensor:
        """The sampling distribution of each row of finite logits.

        Args:
            logits: (V,) or (N, V) logits, any float dtype.
            history: the tokens each row has seen (when a penalty is set).

        Returns:
            float64 probabilities of the same shape; greedy: one-hot at the adjusted argmax.
        """
        x = self.adjust(logits, history).detach().to(torch.float64)
        if self.greedy:
            return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        x = x - x.amax(-1, keepdim=True)  # <= 0, the max exactly 0: no overflow below
        if self.temperature != 1:
            x = x / self.temperature
        if self._warp:  # transformers' warpers take (N, V) scores; these read no input ids
            x2 = x.reshape(-1, x.shape[-1])
            x = self._warp(torch.empty(x2.shape[0], 0, dtype=torch.long), x2).reshape(x.shape)
        return torch.softmax(x, dim=-1)

    def argmax(self, logits: torch.Tensor, history: History | None = None) -> torch.Tensor:
        """Greedy's token per row (first of equal maxima of the adjusted logits): int64, () or (N,)."""
        return self.adjust(logits, history).argmax(-1)

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None,
               history: History | None = None) -> torch.Tensor:
        """Picks one token per row.

        Args:
            logits: (V,) or (N, V) finite logits.
            generator: the random source of the samples (None: torch's global one).
            history: the tokens each row has seen (when a penalty is set); the caller adds to it.

        Returns:
            int64 token ids, () or (N,): `argmax` when greedy, else a sample of `probs`.
        """
        if self.greedy:
            return self.argmax(logits, history)
        return draw(self.probs(logits, history), generator)


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probabilities (or weights) p, (V,) or (N, V): int64, () or (N,)."""
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).reshape(p.shape[:-1])
