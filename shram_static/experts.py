"""The sparse path's expert weights as the static step reads them: gathered rows per token.

`BEA` (layers.py) holds the checkpoint layout, one (d, u) matrix per expert and projection.
`FusedExperts` is the layout an exported step reads: q, k and v of each expert as one
(3u, d) block, so the selected experts' three projections are one row gather and one batched
matmul. `fuse_experts_` swaps it in on a copy of the model (a source transformation, as in
ExecuTorch's llama example); the caller's model is never changed.
"""

import torch
from torch import nn


def gather_experts(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Weights of the selected experts: w (L, a, b), idx (B, C, K) -> (B, C, K, a, b).

    One 1-D index_select over the leading dim, not `w[idx]`: ExecuTorch runs the latter as an
    element-wise portable index.Tensor (measured 0.9 ms per projection per layer per token) and
    the former as a copy of K contiguous (a, b) blocks (0.05 ms).
    """
    return w.index_select(0, idx.reshape(-1)).view(*idx.shape, *w.shape[1:])


def mix_experts(o_proj: torch.Tensor, y: torch.Tensor, P: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """sum_k P_k y_k o_proj[idx_k]: y (B, C, K, u), P (B, C, K), idx (B, C, K) -> (B, C, d).

    One batched matmul per token over its K experts' stacked (u, d) rows (`bmm`, not `@`: see
    `masked_attention`).
    """
    B, C, K, u = y.shape
    wo = gather_experts(o_proj, idx).view(B * C, K * u, -1)  # (BC, K*u, d)
    return torch.bmm((y * P[..., None]).reshape(B * C, 1, K * u), wo).view(B, C, -1)


class FusedExperts(nn.Module):
    """Expert weights in the exported step's layout: `qkv` (L, 3u, d), `o_proj` (L, u, d).

    Same interface as `BEA` (`project`, `output`). WHY a fused, transposed layout: the rows
    gathered for a token's K experts are then one contiguous (3Ku, d) matrix that multiplies
    h as a column, one index_select and one bmm instead of three of each plus an expand of h
    (each a portable kernel, or a delegate boundary, in the .pte).

    Args:
        bea: the `BEA` whose weights it takes (copied into the fused layout; not kept).
    """

    def __init__(self, bea: nn.Module):
        super().__init__()
        qkv = torch.cat([bea.q_proj, bea.k_proj, bea.v_proj], dim=-1)  # (L, d, 3u)
        self.qkv = nn.Parameter(qkv.detach().transpose(1, 2).contiguous(), requires_grad=False)
        self.o_proj = bea.o_proj
        self.head_dim = bea.q_proj.shape[-1]

    def project(self, h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the selected experts: h (B, C, d), idx (B, C, K) -> 3 x (B, C, K, u)."""
        B, C, d = h.shape
        K, u = idx.shape[-1], self.head_dim
        w = gather_experts(self.qkv, idx).view(B * C, K * 3 * u, d)  # (BC, 3Ku, d)
        y = torch.bmm(w, h.reshape(B * C, d, 1)).view(B, C, K, 3, u)
        return y[..., 0, :], y[..., 1, :], y[..., 2, :]

    def output(self, y: torch.Tensor, P: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """See `mix_experts`."""
        return mix_experts(self.o_proj, y, P, idx)


def fuse_experts_(model: nn.Module) -> nn.Module:
    """Replaces every `BEA` of `model` by a `FusedExperts`, in place; returns `model`.

    Use on a model copy that owns its weights (an export copy): the fused tensor is new, and
    the replaced q/k/v tensors are dropped with the `BEA`.
    """
    from .layers import MoSRAH

    for m in model.modules():
        if isinstance(m, MoSRAH) and not isinstance(m.bea, FusedExperts):
            m.bea = FusedExperts(m.bea)
    return model
