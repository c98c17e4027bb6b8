"""Parameter-holding modules of one SHRAM decoder layer, named as in the checkpoint (docs/design.md, "Checkpoint layout").

They hold weights and the position-free math (norms, projections, MLP, the selected experts'
projections). Attention over a sequence lives in `model.py` (uncached forward) and `step.py`
(static prefill/decode), which call these modules with explicit tensors. The fast paths that
replace some of these layers on a copy of the model are in `fast_layers.py`.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ShramConfig
from .reductions import mean_last


def gather_experts(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Weights of the selected experts: w (L, a, b), idx (B, C, K) -> (B, C, K, a, b).

    One 1-D index_select over the leading dim, not `w[idx]`: ExecuTorch runs the latter as an
    element-wise portable index.Tensor, the former as a copy of K contiguous (a, b) blocks, far
    faster (docs/performance.md, "`.pte`").
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


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(mean_last(xf * xf) + self.eps)  # mean_last: stays in XNNPACK
        return self.weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LocalAttention(nn.Module):
    """Sliding-window multi-head attention weights: H heads of width u."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        d, hu = config.embedding_width, config.num_sliding_window_heads * config.head_dim
        self.num_heads, self.head_dim = config.num_sliding_window_heads, config.head_dim
        self.q_proj = nn.Linear(d, hu, bias=False)
        self.k_proj = nn.Linear(d, hu, bias=False)
        self.v_proj = nn.Linear(d, hu, bias=False)
        self.o_proj = nn.Linear(hu, d, bias=False)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, C, d) -> q, k, v each (B, H, C, u)."""
        B, C, _ = h.shape
        split = lambda proj: proj(h).view(B, C, self.num_heads, self.head_dim).transpose(1, 2)
        return split(self.q_proj), split(self.k_proj), split(self.v_proj)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, C, u) -> (B, C, d)."""
        B, H, C, u = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, C, H * u))


class Router(nn.Module):
    """The MoSRAH router's weight (L, d); `routing.route` computes with it.

    `fused` (False): set on the compiled steps' copy by `fast_layers.row_linear_`, where
    `route` then computes the logits and the top-k in forms Inductor fuses (`routing.route`).
    """

    fused = False

    def __init__(self, config: ShramConfig):
        super().__init__()
        self.routing_weight = nn.Parameter(torch.empty(config.num_mosrah_heads, config.embedding_width))


class BEA(nn.Module):
    """Expert-head weights of the sparse path: one (d, u) matrix per expert and projection."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        L, d, u = config.num_mosrah_heads, config.embedding_width, config.head_dim
        self.q_proj = nn.Parameter(torch.empty(L, d, u))
        self.k_proj = nn.Parameter(torch.empty(L, d, u))
        self.v_proj = nn.Parameter(torch.empty(L, d, u))
        self.o_proj = nn.Parameter(torch.empty(L, u, d))

    def select(self, idx: torch.Tensor, hot: torch.Tensor | None = None) -> torch.Tensor:
        """The selection `project` and `output` take: the expert indices idx (B, C, K) as they are
        (`FusedExperts.select` takes or makes their one-hot form `hot`, unused here)."""
        return idx

    def project(self, h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the selected experts: h (B, C, d), idx (`select`: B, C, K) -> 3 x (B, C, K, u)."""
        return tuple(torch.einsum("bcd,bckdu->bcku", h, gather_experts(w, idx))
                     for w in (self.q_proj, self.k_proj, self.v_proj))

    def project_all(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of every expert (the uncached forward's dense sparse path): h (B, N, d) ->
        3 x (B, L, N, u)."""
        return tuple(torch.einsum("bnd,ldu->blnu", h, w) for w in (self.q_proj, self.k_proj, self.v_proj))

    def output_all(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every expert's outputs y (B, L, N, u) mixed by w (B, N, L) -> (B, N, d)."""
        return torch.einsum("blnu,lud,bnl->bnd", y, self.o_proj, w)

    def output(self, y: torch.Tensor, P: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Selected experts' outputs y (B, C, K, u) mixed by P (B, C, K), idx (`select`) -> (B, C, d)."""
        return mix_experts(self.o_proj, y, P, idx)


class MoSRAH(nn.Module):
    def __init__(self, config: ShramConfig):
        super().__init__()
        self.router = Router(config)
        self.bea = BEA(config)


class HybridAttention(nn.Module):
    def __init__(self, config: ShramConfig):
        super().__init__()
        self.local_attention = LocalAttention(config)
        self.sparse_attention = MoSRAH(config)


class DecoderLayer(nn.Module):
    """Weights of one layer; `forward` applies the pre-norm residual structure around a given
    attention function: a = x + g_attn * attn(norm(x)); x = a + g_mlp * mlp(norm(a))."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        d = config.embedding_width
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.mlp_norm = RMSNorm(d, config.rms_norm_eps)
        self.attention = HybridAttention(config)
        self.mlp = SwiGLU(d, config.mlp_width)
        if config.use_residual_gate:
            self.attn_residual_scale = nn.Parameter(torch.ones(1))
            self.mlp_residual_scale = nn.Parameter(torch.ones(1))
        else:
            fixed = torch.full((1,), 1.0 / math.sqrt(config.num_decoder_layers))
            self.register_buffer("attn_residual_scale", fixed.clone())
            self.register_buffer("mlp_residual_scale", fixed.clone())

    def forward(self, x: torch.Tensor, attn) -> torch.Tensor:
        a = x + self.attn_residual_scale * attn(self.attn_norm(x))
        return a + self.mlp_residual_scale * self.mlp(self.mlp_norm(a))
