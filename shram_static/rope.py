"""Rotary position embeddings: plain RoPE for the local path, YaRN for the sparse path
(docs/design.md, "RoPE and YaRN")."""

import math

import torch
from torch import nn

from .config import ShramConfig


def rope_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/u), i = 0..u/2-1: (u/2,) fp32."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def yarn_frequencies(head_dim: int, base: float, train_range: float, s: float,
                     alpha: float, beta: float) -> torch.Tensor:
    """(u/2,) fp32 YaRN frequencies theta'_i for training range C = `train_range` and factor s."""
    theta = rope_frequencies(head_dim, base)
    r = train_range * theta / (2 * math.pi)
    gamma = ((r - alpha) / (beta - alpha)).clamp(0.0, 1.0)
    return (1 - gamma) * theta / s + gamma * theta


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x (..., u) by per-position fp32 tables cos/sin broadcastable to x; computes in
    fp32 and returns x's dtype."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class RotaryTables(nn.Module):
    """Non-persistent cos/sin tables of both paths, covering every position the capacity allows.
    Lookups clamp positions, so a graph called out of range never indexes out of bounds."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        u, s = config.head_dim, config.scale
        n = max(config.inference_sequence_length, config.mosrah_cache_length)
        main = config.rope_mode == "main_sequence"
        train_range = config.training_sequence_length if main else config.mosrah_packed_length
        yarn = yarn_frequencies(u, config.mosrah_rope_theta, train_range, s, config.alpha, config.beta)
        t = torch.arange(n, dtype=torch.int64).float()  # positions 0..n-1
        for path, freqs in (("local", rope_frequencies(u, config.local_rope_theta)), ("sparse", yarn)):
            ang = torch.outer(t, freqs)  # (n, u/2)
            ang = torch.cat([ang, ang], dim=-1)  # (n, u): both halves ("rotate half")
            self.register_buffer(f"{path}_cos", ang.cos(), persistent=False)
            self.register_buffer(f"{path}_sin", ang.sin(), persistent=False)
        self.sparse_factor = (0.1 * math.log(s) + 1.0) ** 2 if s > 1 else 1.0  # YaRN's A; 1 at s = 1
        self.length = n

    def _apply(self, fn, recurse=True):
        # keep the tables fp32 when the model is cast to bf16/fp16; moves still apply
        super()._apply(fn, recurse)
        for name in ("local_cos", "local_sin", "sparse_cos", "sparse_sin"):
            setattr(self, name, getattr(self, name).float())
        return self

    def local(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at integer positions pos (...) -> (..., u)."""
        pos = pos.clamp(0, self.length - 1)
        return self.local_cos[pos], self.local_sin[pos]

    def sparse(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """YaRN cos, sin at integer positions pos (...) -> (..., u)."""
        pos = pos.clamp(0, self.length - 1)
        return self.sparse_cos[pos], self.sparse_sin[pos]
