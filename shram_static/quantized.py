"""Weight-only int8 and int4 linear layers for PyTorch (eager, `torch.compile`, `generate()`), and
the swap that puts them in place of a model's `nn.Linear` layers.

gpt-fast style: plain modules holding plain buffers (an integer weight and fp16 scales), no
tensor subclass. WHY no torchao config: its quantized weights are tensor subclasses, which the
compiled step's per-layer nested region (invoke_subgraph) refuses, and with the layers inlined
Inductor lowers its int8 weight-only linear to an fp32 matmul over a converted copy of the
weight (5.4x the fp32 step's time on the bench model; docs/performance.md, "Quantization").

* `Int8Linear`: int8 weights, one scale per block of GROUP inputs of an output (llama.cpp's
  q8_0: amax / 127).
* `Int4Linear`: 4-bit weights, one scale per block of GROUP inputs of an output (llama.cpp's
  q4_0: the block's value of largest magnitude is -8 steps, zero exact).

Both run every row count, eager and compiled, through the integer dot-product ops of
`int_kernels` (each row quantized to int8 per block of GROUP, as llama.cpp's q8_0 activations),
so the compiled step, the uncached forward and `generate()` compute the same numbers. Where the
ops could not be built, they multiply by the dequantized float weight instead.

`quantize_linears_` swaps them in on a copy (`StaticDecoder(quantize=...)` on its own copy);
`quantized_model` returns such a copy for `generate()`. The layers are a snapshot: they do not
follow later changes of the float weights they were made from.
"""

import torch
from torch import nn

from . import int_kernels
from .backends import quantize_modes
from .fast_layers import shared_copy, swap_linears_

QUANTIZE_MODES = quantize_modes("compiled")  # the `compiled-*` backends' modes
GROUP = int_kernels.BLOCK  # inputs per weight scale (q4_0's and q8_0's block)


def check_quantize(mode) -> None:
    """Raises ValueError unless `mode` is None or one of QUANTIZE_MODES."""
    if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be None or one of {QUANTIZE_MODES}, got {mode!r}")


class _IntLinear(nn.Module):
    """A bias-free linear over a weight quantized per block of GROUP inputs (`int_kernels.pack`'s
    layout). Subclasses set BITS and `quantize`."""

    BITS = 0

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

    @staticmethod
    def quantize(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, G, GROUP) float -> (q (out, G, GROUP) integers, s (out, G) fp16)."""
        raise NotImplementedError

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
    """Scales as fp16 (what the weight stores) and, as float32, the step q is rounded against:
    infinite where the fp16 scale is 0 (a zero block, or one too small for fp16: its q are 0)."""
    s16 = s.to(torch.float16)
    return s16, torch.where(s16 == 0, torch.full_like(s, float("inf")), s16.float())


class Int8Linear(_IntLinear):
    """Weight-only int8 `nn.Linear` (no bias): q in [-127, 127], one fp16 scale per block of
    GROUP inputs of an output (amax / 127).

    Args:
        weight: (out, in) float; quantized here (not kept).

    Buffers: `packed` (ceil(out / 16), ceil(in / GROUP), 8, 64) uint8 and `scale`
    (ceil(out / 16), ceil(in / GROUP), 16) fp16 (`int_kernels.pack`).
    """

    BITS = 8

    @staticmethod
    def quantize(wg):
        s16, step = _fp16_steps(wg.abs().amax(-1) / 127)
        return torch.round(wg / step[..., None]).clamp(-127, 127), s16


class Int4Linear(_IntLinear):
    """Weight-only 4-bit `nn.Linear` (no bias): q in [-8, 7], one fp16 scale per block of GROUP
    inputs of an output (the block's value of largest magnitude is -8 steps, as q4_0).

    Args:
        weight: (out, in) float; quantized here (not kept).

    Buffers: `packed` (ceil(out / 16), ceil(in / GROUP), 4, 64) uint8 (two weights a byte) and
    `scale` (ceil(out / 16), ceil(in / GROUP), 16) fp16 (`int_kernels.pack`).
    """

    BITS = 4

    @staticmethod
    def quantize(wg):
        big = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))[..., 0]  # signed value of max |w|
        s16, step = _fp16_steps(big / -8)
        return torch.round(wg / step[..., None]).clamp(-8, 7), s16


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
