"""The sparse path's expert weights as the static steps read them.

`BEA` (layers.py) holds the checkpoint layout, one (d, u) matrix per expert and projection, and
gathers the selected experts' matrices per token (`gather_experts`, `mix_experts`): what eager
and compiled torch run. `FusedExperts` is the layout an exported step reads: every expert's
q, k, v as one linear layer and every expert's output projection as another, the selected
experts picked from the outputs. `fuse_experts_` swaps it in on a copy of the model (a source
transformation, as in ExecuTorch's llama example); the caller's model is never changed.
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
    """Expert weights in the exported step's layout: every expert as one linear layer each way,
    `qkv` (d -> L*3u: q, k, v of expert l at rows l*3u..) and `o` (L*u -> d).

    Same interface as `BEA` (`select`, `project`, `output`, `project_all`, `output_all`). WHY every
    expert instead of the K selected: gathering the selected experts' blocks is a portable copy,
    per token, of weights the step then reads again (at prefill, 32 tokens copied 12.5 MB per
    bench layer), while one linear
    over all L experts is a single weight read in an XNNPACK delegate, and a token's K results
    are picked from its small output. Measured on the bench model's `.pte` against gathering:
    decode 10.9 vs 11.3 ms at batch 1 (though it reads L/K times the expert bytes), 16.5 vs
    17.5 ms at batch 4, prefill 1.23x faster; int8 decode 5.2 vs 5.8 ms, as nn.Linear layers
    are quantized like every other projection (export/probes/README.md, section 10).

    Args:
        bea: the `BEA` whose weights it takes (copied into the fused layout; not kept).
    """

    def __init__(self, bea: nn.Module):
        super().__init__()
        L, d, u = bea.q_proj.shape
        self.num_experts, self.head_dim = L, u
        qkv = torch.cat([bea.q_proj, bea.k_proj, bea.v_proj], dim=-1)  # (L, d, 3u)
        like = dict(dtype=bea.q_proj.dtype, device=bea.q_proj.device)
        self.qkv = nn.Linear(d, L * 3 * u, bias=False, **like)
        self.o = nn.Linear(L * u, d, bias=False, **like)
        with torch.no_grad():
            self.qkv.weight.copy_(qkv.transpose(1, 2).reshape(L * 3 * u, d))  # row l*3u + j: (q|k|v)_l[:, j]
            self.o.weight.copy_(bea.o_proj.reshape(L * u, d).t())  # column l*u + j: o_proj[l, j]
        self.requires_grad_(False)
        # a constant, not an arange per call (each is a portable op in the exported step)
        self.register_buffer("experts", torch.arange(L, device=like["device"]), persistent=False)

    def select(self, idx: torch.Tensor, hot: torch.Tensor | None = None) -> torch.Tensor:
        """The selection `project` and `output` take: idx (B, C, K) -> one-hot (B*C, K, L) float,
        1 at each selected expert (made once per layer: its == and cast are portable ops);
        `hot`, that one-hot if the caller has made it already (the prefill step does), is taken
        as it is."""
        if hot is not None:
            return hot
        B, C, K = idx.shape
        # view, not idx[..., None]: outside a delegate a view_copy is free, an unsqueeze_copy a kernel
        hot = idx.view(B, C, K, 1) == self.experts  # (B, C, K, L)
        return hot.to(self.o.weight.dtype).view(B * C, K, self.num_experts)

    def project(self, h: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the selected experts: h (B, C, d), sel (`select`) -> 3 x (B, C, K, u)."""
        B, C, _ = h.shape
        K, u, L = sel.shape[1], self.head_dim, self.num_experts
        y = self.qkv(h).view(B * C, L, 3 * u)  # (BC, L, 3u) every expert
        # the selected rows as a one-hot batched matmul (in the delegate; a gather would need
        # its index expanded to the row width, a portable copy). Exact: one 1 per row.
        y = torch.bmm(sel, y).view(B, C, K, 3, u)
        return y[..., 0, :], y[..., 1, :], y[..., 2, :]

    def output(self, y: torch.Tensor, P: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """sum_k P_k y_k o_proj[idx_k]: y (B, C, K, u), P (B, C, K), sel (`select`) -> (B, C, d)."""
        B, C, K, u = y.shape
        L = self.num_experts
        # each token's weighted outputs at its experts' rows (a one-hot batched matmul: 0 at
        # the experts it did not select), then all experts' output projections as one linear
        z = torch.bmm(sel.transpose(1, 2), (y * P[..., None]).view(B * C, K, u))  # (BC, L, u)
        return self.o(z.view(B, C, L * u))

    def project_all(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See `BEA.project_all`."""
        B, N, _ = h.shape
        y = self.qkv(h).view(B, N, self.num_experts, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # (3, B, L, N, u)
        return y[0], y[1], y[2]

    def output_all(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """See `BEA.output_all`."""
        B, L, N, u = y.shape
        return self.o((y * w.transpose(1, 2)[..., None]).transpose(1, 2).reshape(B, N, L * u))


def fuse_experts_(model: nn.Module) -> nn.Module:
    """Replaces every `BEA` of `model` by a `FusedExperts`, in place; returns `model`.

    Use on a model copy that owns its weights (an export copy): the fused weights are new, and
    the replaced `BEA` tensors are dropped with it.
    """
    from .layers import MoSRAH

    for m in model.modules():
        if isinstance(m, MoSRAH) and not isinstance(m.bea, FusedExperts):
            m.bea = FusedExperts(m.bea)
    return model
