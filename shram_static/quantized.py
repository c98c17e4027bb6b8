"""Weight-only int8 and int4 linear layers for PyTorch (eager, `torch.compile`, `generate()`), and
the swap that puts them in place of a model's `nn.Linear` layers.

gpt-fast style: plain modules holding plain buffers (an integer weight and float scales), no
tensor subclass. WHY no torchao config: its quantized weights are tensor subclasses, which the
compiled step's per-layer nested region (invoke_subgraph) refuses, and with the layers inlined
Inductor lowers its int8 weight-only linear to an fp32 matmul over a converted copy of the
weight (5.4x the fp32 step's time on the bench model; docs/performance.md, "Quantization").

* `Int8Linear`: int8 weights, one scale per output channel (symmetric, amax / 127).
* `Int4Linear`: 4-bit weights, two per byte, one scale per group of GROUP inputs of an output
  (llama.cpp's q4_0 scheme: the group's value of largest magnitude is -8 steps, zero exact).

Both store their weight packed in blocks of `fast_layers.LANES` outputs, input-major (the layout
of `RowLinear`): up to FEW_ROWS rows (decode, verify, a prompt's last-token head) a row is a
broadcast product with the packed integer weight summed over the input width, which Inductor
fuses into one loop that reads the integer weight and widens it in registers (one pass over
1 or 0.5 bytes per weight). More rows (a prefill chunk) multiply by a dequantized float copy
made in the step (read once per chunk).

`quantize_linears_` swaps them in on a copy (`StaticDecoder(quantize=...)` on its own copy);
`quantized_model` returns such a copy for `generate()`. The layers are a snapshot: they do not
follow later changes of the float weights they were made from.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .backends import quantize_modes
from .fast_layers import FEW_ROWS, LANES, pack_rows, shared_copy, swap_linears_

QUANTIZE_MODES = quantize_modes("compiled")  # the `compiled-*` backends' modes
GROUP = 32  # inputs per int4 scale (q4_0's block)


def check_quantize(mode) -> None:
    """Raises ValueError unless `mode` is None or one of QUANTIZE_MODES."""
    if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be None or one of {QUANTIZE_MODES}, got {mode!r}")


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


class Int8Linear(nn.Module):
    """Weight-only int8 `nn.Linear` (no bias): y = (x @ q.T) * scale.

    Args:
        weight: (out, in) float; quantized here (not kept).

    Buffers: `packed` (ceil(out / LANES), in, LANES) int8 (`pack_rows` of q), `scale` (out,)
    float32.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.detach().float()
        N, K = w.shape
        self.out_features, self.in_features = N, K
        s = w.abs().amax(1).clamp(min=1e-12) / 127  # (N,)
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("packed", pack_rows(q))  # (nb, K, LANES)
        self.register_buffer("scale", s)

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32 weight."""
        nb, K, v = self.packed.shape
        q = self.packed.transpose(1, 2).reshape(nb * v, K)[:self.out_features]
        return q.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out) in x's dtype."""
        n, N = _rows(x), self.out_features
        if n > FEW_ROWS or not torch.compiler.is_compiling():
            # WHY eager takes the matmul: outside Inductor the row form below would widen the
            # whole weight to float per row anyway
            return F.linear(x.float(), self.dequantized()).to(x.dtype)
        wp = self.packed  # (nb, K, LANES) int8: widened inside the fused loop
        nb, K, v = wp.shape
        xs = x.reshape(n, K).float()
        y = torch.stack([(xs[r].view(1, K, 1) * wp.float()).sum(1) for r in range(n)])  # (n, nb, LANES)
        y = y.view(n, nb * v)[:, :N] * self.scale  # (n, out)
        return y.to(x.dtype).reshape(*x.shape[:-1], N)


class Int4Linear(nn.Module):
    """Weight-only 4-bit `nn.Linear` (no bias), one scale per GROUP inputs of each output.

    The input width is padded with zero weights to a multiple of 2 * GROUP (Kp); byte k of an
    output holds input k in its low nibble and input k + Kp/2 in its high one, each as q + 8
    with q in [-8, 7] (w ~ q * scale of its group). WHY halves, not neighbours: a row then sums
    two contiguous runs of x, with no interleaving shuffle in the fused loop.

    Args:
        weight: (out, in) float; quantized here (not kept).

    Buffers: `packed` (ceil(out / LANES), Kp / 2, LANES) uint8, `scale` (ceil(out / LANES),
    Kp / GROUP, LANES) float32 (padded outputs: scale 0).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.detach().float()
        N, K = w.shape
        self.out_features, self.in_features = N, K
        Kp = -(-K // (2 * GROUP)) * 2 * GROUP
        wg = F.pad(w, (0, Kp - K)).view(N, Kp // GROUP, GROUP)
        big = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))  # (N, Kp/G, 1) signed value of max |w|
        s = big / -8
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = (torch.round(wg / s).clamp(-8, 7) + 8).to(torch.uint8).view(N, Kp)  # 0..15
        H = Kp // 2
        self.register_buffer("packed", pack_rows(q[:, :H] | (q[:, H:] << 4)))  # (nb, H, LANES)
        self.register_buffer("scale", pack_rows(torch.where(big == 0, 0.0, s)[..., 0]))  # (nb, Kp/G, LANES)

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32 weight."""
        nb, H, v = self.packed.shape
        lo, hi = self._nibbles()  # 2 x (nb, H/G, G, LANES)
        s = self.scale.view(nb, 2, H // GROUP, 1, v)
        w = torch.cat([lo * s[:, 0], hi * s[:, 1]], 1).reshape(nb, 2 * H, v)  # (nb, Kp, LANES)
        return w.transpose(1, 2).reshape(nb * v, 2 * H)[:self.out_features, :self.in_features]

    def _nibbles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The low and high halves' q as float, each (nb, H/G, G, LANES)."""
        nb, H, v = self.packed.shape
        b = self.packed.view(nb, H // GROUP, GROUP, v)
        return (b & 15).float() - 8, (b >> 4).float() - 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out) in x's dtype."""
        n, N, K = _rows(x), self.out_features, self.in_features
        if n > FEW_ROWS or not torch.compiler.is_compiling():
            return F.linear(x.float(), self.dequantized()).to(x.dtype)
        nb, H, v = self.packed.shape
        g = H // GROUP  # groups per half
        xs = F.pad(x.reshape(n, K).float(), (0, 2 * H - K)).view(n, 2, g, GROUP, 1)
        lo, hi = self._nibbles()
        s = self.scale.view(nb, 2, g, v)
        # per group, the sum of x * q, then the group's scale: one multiply per group, not per weight
        y = torch.stack([((xs[r, 0] * lo).sum(2) * s[:, 0] + (xs[r, 1] * hi).sum(2) * s[:, 1]).sum(1)
                         for r in range(n)])  # (n, nb, LANES)
        y = y.view(n, nb * v)[:, :N]
        return y.to(x.dtype).reshape(*x.shape[:-1], N)


LAYERS = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linears_(model: nn.Module, mode: str) -> nn.Module:
    """Replaces every bias-free `nn.Linear` of `model` (every projection, the MLP, the lm_head;
    a tied lm_head gets its own quantized copy of the table) by an `Int8Linear` or `Int4Linear`,
    in place; returns `model`. The embedding table, the router and the sparse path's expert
    weights stay as they are (a decode step reads one embedding row and K of the L experts:
    a few percent of its bytes). Use on a `shared_copy`.

    Args:
        model: a `ShramForCausalLM` copy.
        mode: "int8" or "int4".
    """
    check_quantize(mode)
    if mode is None:
        raise ValueError("quantize_linears_ needs a mode")
    return swap_linears_(model, LAYERS[mode])


def quantized_model(model: nn.Module, mode: str) -> nn.Module:
    """A copy of `model` with int8 or int4 weight-only linear layers (`quantize_linears_`),
    sharing every other weight with it; `model` is not changed. The copy is a
    `ShramForCausalLM` like the original: `generate()`, the uncached forward and
    `StaticDecoder` run it.

    Args:
        model: a `ShramForCausalLM`.
        mode: "int8" or "int4".

    Returns:
        The quantized copy, in eval mode.
    """
    return quantize_linears_(shared_copy(model).eval(), mode)
