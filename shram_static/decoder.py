"""`StaticDecoder`: the static steps in PyTorch, eager or `torch.compile(fullgraph=True)`."""

import torch

from .host import HostDecoder
from .state import StaticState
from .step import StepModule


def gemv_layout_(model):
    """Stores every nn.Linear weight transposed in memory (same shape and values).

    A decode step multiplies one row per sequence by each weight. MKL's GEMV streams a
    weight stored (in, out) row-major at ~15-19 GB/s here but the (out, in) layout of
    nn.Linear at ~10 GB/s (measured on the 50277x512 lm_head: 19.4 vs 9.7 GB/s), and
    `F.linear(x, w)` with `w` column-major hands MKL exactly the fast layout. Parameter shapes,
    values and `state_dict()` are unchanged. Returns the model.
    """
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.is_contiguous():
                m.weight.data = m.weight.data.t().contiguous().t()
    return model


class StaticDecoder(HostDecoder):
    """Decodes with fixed-shape state: two step functions over buffers allocated once.

    Args:
        model: a `ShramForCausalLM` (eval mode; its dtype and device are used for the state).
        batch_size: B rows.
        prefill_chunk: C tokens per prefill step (prompts are split into C-token chunks).
        compile: wrap both steps in `torch.compile(fullgraph=True, dynamic=False)`; each
            compiles once, on first use.
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
        self.model = gemv_layout_(model.eval())
        self.state = StaticState(model.config, batch_size, prefill_chunk, dtype=p.dtype, device=p.device)
        self.module = StepModule(self.model, self.state)
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
        return self.module(tokens, input_pos, live)

    def _prefill_step(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return self.module(tokens, input_pos, live)

    @torch.no_grad()
    def _run(self, tokens, input_pos, live):
        fn = self.decode_step if tokens.shape[1] == 1 else self.prefill_step
        d = self.device
        return fn(tokens.to(d), input_pos.to(d), live.to(d))
