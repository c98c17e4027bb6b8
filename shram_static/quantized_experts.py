"""Int8 expert weights for the quantized decoders (`quantized.quantize_linears_`).

Each expert's q|k|v (d -> 3u) and o (u -> d) as int8 with one float scale per expert and output
channel. A token's K blocks are gathered as int8 and scaled inside the step's own loops, so the
compiled step reads a quarter of the bytes and makes no extra call. WHY not the integer ops of
`int_kernels`: two more operator calls per layer cost the compiled step's Python wrapper about
what the smaller reads save (docs/performance.md, "Quantization").
"""
import torch
from torch import nn

from .attention import prefix_blocks
from .fast_layers import FEW_ROWS
from .layers import BEA, gather_experts


def quantize_columns(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output column: w (L, n_in, n_out) float -> int8 (L, n_in, n_out), scale
    (L, 1, n_out) float32, w ~= q * scale."""
    s = w.abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / s).clamp(-127, 127).to(torch.int8), s


class Int8Experts(BEA):
    """`BEA`'s interface over int8 copies of the expert weights (a snapshot: not the float ones'
    later changes).

    Args:
        bea: the float `BEA` (not changed).
    """

    prefix = staticmethod(prefix_blocks)  # a slot's values loaded as one vector (`attention`)

    def __init__(self, bea: BEA):
        nn.Module.__init__(self)
        qkv = torch.cat([w.detach().float() for w in (bea.q_proj, bea.k_proj, bea.v_proj)], -1)  # (L, d, 3u)
        self.head_dim = bea.q_proj.shape[-1]
        for name, w in (("qkv", qkv), ("o", bea.o_proj.detach().float())):  # o: (L, u, d)
            q, s = quantize_columns(w)
            self.register_buffer(f"{name}_q", q, persistent=False)
            self.register_buffer(f"{name}_scale", s, persistent=False)

    def _dequantized(self, name: str) -> torch.Tensor:
        return getattr(self, f"{name}_q").float() * getattr(self, f"{name}_scale")

    def _split(self, y: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u = self.head_dim
        y = y.to(h.dtype)
        return y[..., :u], y[..., u:2 * u], y[..., 2 * u:]

    def project(self, h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See `BEA.project`: up to FEW_ROWS tokens per row, each token's K int8 blocks; more (a
        prefill chunk), every expert as one batched matmul and each token's K picked."""
        B, C, d = h.shape
        if C > FEW_ROWS:
            y = torch.matmul(h.float().reshape(1, B * C, d), self._dequantized("qkv"))  # (L, BC, 3u)
            pick = idx.reshape(B * C, -1, 1).expand(-1, -1, y.shape[-1])  # (BC, K, 3u)
            return self._split(y.transpose(0, 1).gather(1, pick).view(B, C, -1, y.shape[-1]), h)
        w = gather_experts(self.qkv_q, idx).float()  # (B, C, K, d, 3u)
        y = (h.float()[:, :, None, :, None] * w).sum(-2) * gather_experts(self.qkv_scale, idx)[..., 0, :]
        return self._split(y, h)  # (B, C, K, 3u) -> 3 x (B, C, K, u)

    def output(self, y: torch.Tensor, P: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """See `BEA.output`."""
        B, C, K, u = y.shape
        wo = gather_experts(self.o_q, idx).float() * gather_experts(self.o_scale, idx)  # (B, C, K, u, d)
        z = (y.float() * P[..., None]).reshape(B * C, 1, K * u)
        return torch.bmm(z, wo.view(B * C, K * u, -1)).view(B, C, -1).to(y.dtype)

    def project_all(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See `BEA.project_all` (the uncached forward)."""
        y = torch.einsum("bnd,ldu->blnu", h.float(), self._dequantized("qkv"))  # (B, L, N, 3u)
        return self._split(y, h)

    def output_all(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """See `BEA.output_all`."""
        return torch.einsum("blnu,lud,bnl->bnd", y.float(), self._dequantized("o"), w.float()).to(y.dtype)
