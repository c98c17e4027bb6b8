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
from .fast_layers import expert_products, qkv_thirds
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
        for name, w in (("qkv", qkv), ("o", bea.o_proj.detach().float())):  # o: (L, u, d)
            q, s = quantize_columns(w)
            self.register_buffer(f"{name}_q", q, persistent=False)
            self.register_buffer(f"{name}_scale", s, persistent=False)

    def project(self, h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See `BEA.project` (`fast_layers.expert_products` over the int8 weights)."""
        return expert_products(h, idx, self.qkv_q, self.qkv_scale)

    def output_blocks(self, idx: torch.Tensor) -> torch.Tensor:
        """See `BEA.output_blocks`: dequantized as gathered."""
        return gather_experts(self.o_q, idx).float() * gather_experts(self.o_scale, idx)

    def dense_weights(self) -> tuple[torch.Tensor, ...]:
        """See `BEA.dense_weights`: the int8 weights times their scales, float32."""
        return (*qkv_thirds(self.qkv_q.float() * self.qkv_scale), self.o_q.float() * self.o_scale)
