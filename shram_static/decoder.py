"""`StaticDecoder`: the static steps in PyTorch, eager or `torch.compile(fullgraph=True)`."""

import torch
import torch.nn.functional as F

from .host import HostDecoder
from .state import StaticState
from .step import StepModule


def weight_layout_(model, column_major: bool):
    """Stores every nn.Linear weight column- or row-major in memory (same shape and values).

    A decode step multiplies one row per sequence by each weight, so it streams every weight
    once and its speed is the read bandwidth each layout gets:
      * MKL's GEMV (eager, and compiled steps with several rows) streams a weight stored
        (in, out) row-major, i.e. an (out, in) column-major `w`, at ~15-19 GB/s here, but the
        (out, in) row-major layout of nn.Linear at ~10 GB/s (50277x512 lm_head: 19.4 vs 9.7 GB/s).
      * `row_linear` (the compiled batch-1 decode step) reduces contiguous rows of a row-major
        `w` at ~26-34 GB/s (bench model's 85 linears: 8.9 ms row_linear vs 14.5 ms mm).
    Parameter shapes, values and `state_dict()` are unchanged. Returns the model.
    """
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight.data
                m.weight.data = w.t().contiguous().t() if column_major else w.contiguous()
    return model


def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` for the compiled decode step: with ONE row and a row-major `w`, an
    elementwise product reduced over the input width, which Inductor turns into a single pass
    over `w` at near the machine's read bandwidth (WHY: MKL's GEMV reaches ~55% of it here, and
    a decode step is GEMVs). Anything else goes to F.linear: for several rows a reduction would
    re-read `w` per row, and eagerly it would materialise (out, in). Accumulates in fp32.

    Args:
        x: (..., in), w: (out, in).

    Returns:
        (..., out) in x's dtype.
    """
    if x.numel() != x.shape[-1] or not w.is_contiguous() or type(w) not in (torch.Tensor, torch.nn.Parameter):
        return F.linear(x, w)
    return (x[..., None, :].float() * w.float()).sum(-1).to(x.dtype)  # (..., out)


class StaticDecoder(HostDecoder):
    """Decodes with fixed-shape state: two step functions over buffers allocated once.

    Args:
        model: a `ShramForCausalLM` (eval mode; its dtype and device are used for the state).
        batch_size: B rows.
        prefill_chunk: C tokens per prefill step (prompts are split into C-token chunks).
        compile: wrap both steps in `torch.compile(fullgraph=True, dynamic=False)`; each
            compiles once, on first use. With batch_size 1 on CPU the compiled decode step
            runs its projections as `row_linear` (row-major weights); see `weight_layout_`.
        eos_token_id: id that ends a row in `generate`.

    The decode step is `decode_step(tokens (B, 1), input_pos (B,), live (B, 1))`, the prefill
    step `prefill_step(tokens (B, C), input_pos (B,), live (B, C))`; both return logits
    (B, 1 or C, V) and update `self.state` in place.
    """

    def __init__(self, model, batch_size: int = 1, prefill_chunk: int = 32, compile: bool = False,
                 eos_token_id: int | None = None):
        super().__init__(model.config, batch_size, prefill_chunk, eos_token_id)
        p = next(model.parameters())
        self.device = p.device
        # The compiled batch-1 decode step runs its projections as `row_linear`.
        rows = compile and batch_size == 1 and p.device.type == "cpu"
        self.model = weight_layout_(model.eval(), column_major=not rows)
        self.state = StaticState(model.config, batch_size, prefill_chunk, dtype=p.dtype, device=p.device)
        self.module = StepModule(self.model, self.state)
        self.decode_module = StepModule(self.model, self.state, linear=row_linear) if rows else self.module
        self.compiled = compile
        if compile:
            # Two separate compiled functions (two code objects), so each step owns exactly
            # one graph and neither shape ever triggers a recompile of the other.
            self.decode_step = torch.compile(self._decode_step, fullgraph=True, dynamic=False)
            self.prefill_step = torch.compile(self._prefill_step, fullgraph=True, dynamic=False)
        else:
            self.decode_step = self._decode_step
            self.prefill_step = self._prefill_step

    def _decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return self.decode_module(tokens, input_pos, live)

    def _prefill_step(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return self.module(tokens, input_pos, live)

    @torch.no_grad()
    def _run(self, tokens, input_pos, live):
        fn = self.decode_step if tokens.shape[1] == 1 else self.prefill_step
        d = self.device
        return fn(tokens.to(d), input_pos.to(d), live.to(d))
