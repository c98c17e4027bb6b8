"""Weight-only int8 and int4 linear layers for PyTorch (eager, `torch.compile`, `generate()`), and
the swap that puts them in place of a model's `nn.Linear` layers on a copy.

Plain modules over plain buffers (integer weights, fp16 scales per block of GROUP inputs, as
llama.cpp's q8_0 / q4_0), run through `int_kernels`' integer ops (their float path where those
could not be built). WHY not torchao: its tensor-subclass weights are refused by the compiled
step's nested regions. The layers are a snapshot: they do not follow the float weights.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import int_kernels
from .backends import quantize_modes
from .fast_layers import shared_copy, swap_children_, swap_linears_
from .layers import BEA, LocalAttention, SwiGLU
from .quantized_experts import Int8Experts

QUANTIZE_MODES = quantize_modes("compiled")  # the `compiled-*` backends' modes
GROUP = int_kernels.BLOCK  # inputs per weight scale (q4_0's and q8_0's block)


def check_quantize(mode) -> None:
    """Raises ValueError unless `mode` is None or one of QUANTIZE_MODES."""
    if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be None or one of {QUANTIZE_MODES}, got {mode!r}")


class _IntLinear(nn.Module):
    """A bias-free linear over a weight quantized per block of GROUP inputs (`int_kernels.pack`);
    subclasses set BITS and `quantize`: (out, G, GROUP) float -> (q integers, s (out, G) fp16)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        int_kernels.load()  # builds the ops on first use
        w = weight.detach().float().cpu()
        N, K = w.shape
        self.out_features, self.in_features = N, K
        G = -(-K // GROUP)
        q, s = self.quantize(torch.nn.functional.pad(w, (0, G * GROUP - K)).view(N, G, GROUP))
        packed, scale = int_kernels.pack(q.view(N, G * GROUP), s, self.BITS)
        self.register_buffer("packed", packed.to(weight.device))  # (nb, G, chunks, 64) uint8
        self.register_buffer("scale", scale.to(weight.device))  # (nb, G, LANES) fp16

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32 weight."""
        return int_kernels.dequantize(self.packed, self.scale, self.BITS, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out) in x's dtype."""
        isa = int_kernels.ISA
        if isa is not None and x.device.type == "cpu":
            return int_kernels.int_linear(x, self.packed, self.scale, self.out_features, self.BITS, isa)
        return int_kernels.float_linear(x, self.packed, self.scale, self.BITS, self.out_features, self.in_features)


def _fp16_steps(s: torch.Tensor) -> torch.Tensor:
    """The fp16 scales, and as float32 the step q is rounded against (inf where the fp16 scale is 0)."""
    s16 = s.to(torch.float16)
    return s16, torch.where(s16 == 0, torch.full_like(s, float("inf")), s16.float())


class Int8Linear(_IntLinear):
    """Weight-only int8 `nn.Linear` (no bias): q in [-127, 127], a scale per block (amax / 127).

    Args:
        weight: (out, in) float; quantized here (not kept) into `packed` and `scale` (`int_kernels.pack`).
    """

    BITS = 8

    @staticmethod
    def quantize(wg):
        s16, step = _fp16_steps(wg.abs().amax(-1) / 127)
        return torch.round(wg / step[..., None]).clamp(-127, 127), s16


class Int4Linear(_IntLinear):
    """Weight-only 4-bit `nn.Linear` (no bias): q in [-8, 7], a scale per block (largest |w| is -8 steps).

    Args:
        weight: (out, in) float; quantized here (not kept) into `packed` and `scale` (`int_kernels.pack`).
    """

    BITS = 4

    @staticmethod
    def quantize(wg):
        big = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))[..., 0]  # signed value of max |w|
        s16, step = _fp16_steps(big / -8)
        return torch.round(wg / step[..., None]).clamp(-8, 7), s16


class FusedQKVAttention(LocalAttention):
    """`LocalAttention` with q, k and v as one quantized layer (rows q | k | v): one integer op per
    step instead of three, each output computed as the three layers compute it."""

    def __init__(self, att: LocalAttention, layer):
        nn.Module.__init__(self)  # WHY not LocalAttention's: it would allocate the float layers again
        self.num_heads, self.head_dim = att.num_heads, att.head_dim
        self.qkv_proj = layer(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
        self.o_proj = layer(att.o_proj.weight)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, C, d) -> q, k, v each (B, H, C, u)."""
        B, C, _ = h.shape
        y = self.qkv_proj(h).view(B, C, 3, self.num_heads, self.head_dim)
        return y[:, :, 0].transpose(1, 2), y[:, :, 1].transpose(1, 2), y[:, :, 2].transpose(1, 2)


class FusedGateUp(SwiGLU):
    """`SwiGLU` with gate and up as one quantized layer (rows gate | up): one integer op instead of two."""

    def __init__(self, mlp: SwiGLU, layer):
        nn.Module.__init__(self)  # WHY not SwiGLU's: it would allocate the float layers again
        self.width = mlp.gate_proj.out_features
        self.gate_up_proj = layer(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down_proj = layer(mlp.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.width, -1)
        return self.down_proj(F.silu(gate) * up)


def quantize_linears_(model: nn.Module, mode: str) -> nn.Module:
    """Replaces every bias-free `nn.Linear` of `model` (a tied lm_head too) by an `Int8Linear` or
    `Int4Linear`, in place, the sliding-window q, k, v and the MLP's gate, up as one layer each
    (`FusedQKVAttention`, `FusedGateUp`), and every `BEA` by `Int8Experts` (int8 in either mode:
    Inductor widens 4-bit values one nibble at a time); the embedding and router stay float.

    Args:
        model: a `ShramForCausalLM` copy (a `shared_copy`).
        mode: "int8" or "int4".

    Returns:
        model.
    """
    check_quantize(mode)
    if mode is None:
        raise ValueError("quantize_linears_ needs a mode")
    layer = {"int8": Int8Linear, "int4": Int4Linear}[mode]
    # the projections that read the same input as one layer each: every integer op is a call from
    # the compiled step's Python wrapper (docs/performance.md, "Quantization")
    swaps = {LocalAttention: lambda c: FusedQKVAttention(c, layer), SwiGLU: lambda c: FusedGateUp(c, layer),
             BEA: Int8Experts}
    swap_children_(model, lambda c: swaps[type(c)](c) if type(c) in swaps else None)
    return swap_linears_(model, layer)


def quantized_model(model: nn.Module, mode: str) -> nn.Module:
    """A copy of `model` with int8 or int4 weight-only linear layers, sharing every other weight.

    Args:
        model: a `ShramForCausalLM` (not changed).
        mode: "int8" or "int4".

    Returns:
        The quantized `ShramForCausalLM` copy, in eval mode.
    """
    return quantize_linears_(shared_copy(model).eval(), mode)
