"""`StaticDecoder`: the static steps in PyTorch, eager or `torch.compile(fullgraph=True)`."""

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_isa import start_isa_checks
from .host import HostDecoder
from .kernel_builds import run_batched
from .state import StaticState
from .step import StepModule


FEW_ROWS = 8  # compiled decode batches up to this size run their projections as RowLinear


# Inductor option for a compiled decode step of 2..FEW_ROWS rows: store a value read by several
# consumers (here: the n row reductions of each RowLinear) instead of recomputing it in each.
# WHY: Inductor inlines a cheap producer such as the RMSNorm into every consumer, and Inductor's
# C++ keeps libm's errno semantics (-fmath-errno), so the norm's rsqrt stays in the innermost
# loop, once per row per 8 weights (the bench model's batch-4 lm_head kernel: 18.4 ms instead
# of ~4). At one row the default fusion is as fast or faster (10.83 vs 11.22 ms, bench model).
ROW_INPUTS_STORED = {"realize_reads_threshold": 1}

# Inductor option for both compiled steps: no `assert_size_stride` calls in the generated
# Python wrapper. WHY: it re-checks, on every call, the sizes and strides of every weight and
# state tensor a step reads (~35 per decoder layer, each a C++ call from Python); Dynamo's
# guards check the same on a step's first call and whenever a tensor is replaced (see
# `skip_guards`), and a step's own inputs come from `_run` in fixed shapes. Built-in model,
# batch 1, one process alternating 15 x 40 steps: 2.68 ms/step with the asserts, 2.23 without.
NO_SIZE_ASSERTS = {"size_asserts": False}


class RowLinear(nn.Module):
    """`nn.Linear` (no bias) for the compiled decode step on CPU.

    Up to FEW_ROWS rows: per row, an elementwise product reduced over the input width
    (accumulated in fp32). Inductor fuses the n reductions into one pass over the row-major
    `weight` with n accumulators, at near the machine's read bandwidth. WHY: MKL's GEMV reached
    ~55% of it here, and a decode step is GEMVs (the bench model's 85 linears: 8.9 ms this way
    vs 14.5 ms as mm at one row); at 4 rows MKL's sgemm re-reads W per row for X @ W^T, and
    W @ X^T, which streams W once, still lost to the fused reductions (compiled, 8 weights
    rotated: 50277x512 4.87 vs 4.16 ms, 1536x512 0.217 vs 0.159 ms; one row 3.53 / 0.115 ms).
    More rows (prefill) go to F.linear.

    Args:
        weight: (out, in), shared with the module it replaces (never copied).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out) in x's dtype."""
        w = self.weight
        n = x.numel() // x.shape[-1]  # rows
        if n > FEW_ROWS or not w.is_contiguous():
            return F.linear(x, w)
        xs = x.reshape(n, -1).float()  # (n, in)
        wf = w.float()
        y = torch.stack([(xs[r] * wf).sum(-1) for r in range(n)])  # (n, out)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])  # (..., out)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every parameter and buffer with `model`.

    A decoder swaps modules on this copy (source transformations, as ExecuTorch's llama
    example does), so the model it was given never changes and the weights are held once.
    """
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def row_linear_(model: nn.Module) -> nn.Module:
    """Replaces every bias-free nn.Linear of `model` (and a tied lm_head) by a `RowLinear` over
    the same weight, in place; returns `model`. Use on a `shared_copy`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                setattr(parent, name, RowLinear(child.weight))
    if getattr(model, "lm_head", 0) is None:  # tied: the head reads the embedding table
        model.lm_head = RowLinear(model.embed_tokens.weight)
    return model


class StaticDecoder(HostDecoder):
    """Decodes with fixed-shape state: two step functions over buffers allocated once.

    Args:
        model: a `ShramForCausalLM` (eval mode; its dtype and device are used for the state).
        batch_size: B rows.
        prefill_chunk: C tokens per prefill step (prompts are split into C-token chunks).
        compile: wrap both steps in `torch.compile(fullgraph=True, dynamic=False)`; each
            compiles once, on first use. With batch_size <= FEW_ROWS on CPU the compiled decode step
            runs its projections as `RowLinear` on the decoder's own `shared_copy` of the model
            (same weight tensors); the model passed in is never modified. On CPU, Inductor's
            check of the machine's vector ISA starts at once, in the background (`cpu_isa.py`).
        eos_token_id: id that ends a row in `generate`.
        skip_guards: compile only. Once a step has run with Dynamo's guards checked, later
            calls skip them (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`) for as
            long as every weight and state tensor of the step is the one it was checked with
            (same storage; a dtype or device change replaces it, and the next call is checked
            again, as after `torch._dynamo.reset()`). WHY: the decoder fixes every input's
            shape, dtype and strides itself, so ~1400 guards over the step's ~260 tensors can
            never fail between two calls, and checking them took ~1.1 ms of an ~11 ms
            bench-model decode step on this CPU.
            False: check the guards on every call (what `fail_on_recompile` tests need).

    The decode step is `decode_step(tokens (B, 1), input_pos (B,), live (B, 1))`, the prefill
    step `prefill_step(tokens (B, C), input_pos (B,), live (B, C))`; both return logits
    (B, 1 or C, V) and update `self.state` in place.
    """

    def __init__(self, model, batch_size: int = 1, prefill_chunk: int = 32, compile: bool = False,
                 eos_token_id: int | None = None, skip_guards: bool = True):
        super().__init__(model.config, batch_size, prefill_chunk, eos_token_id)
        p = next(model.parameters())
        self.device = p.device
        self.model = shared_copy(model).eval()
        self.state = StaticState(model.config, batch_size, prefill_chunk, dtype=p.dtype, device=p.device)
        self.module = StepModule(self.model, self.state)
        self.decode_module = self.module
        decode_options = NO_SIZE_ASSERTS
        if compile and batch_size <= FEW_ROWS and p.device.type == "cpu":
            self.decode_module = StepModule(row_linear_(shared_copy(self.model)), self.state)
            if batch_size > 1:
                decode_options = {**NO_SIZE_ASSERTS, **ROW_INPUTS_STORED}
        self.compiled = compile
        self.skip_guards = skip_guards
        self._tensors: dict[str, list[torch.Tensor]] = {}  # step -> every weight and state tensor
        self._checked: dict[str, list[int]] = {}  # step -> their storages when guards last passed
        if compile and p.device.type == "cpu":  # Inductor's ISA check, beside the first trace
            start_isa_checks()
        if compile:
            # Two separate compiled functions (two code objects), so each step owns exactly
            # one graph and neither shape ever triggers a recompile of the other.
            self.decode_step = torch.compile(self._decode_step, fullgraph=True, dynamic=False,
                                             options=decode_options)
            self.prefill_step = torch.compile(self._prefill_step, fullgraph=True, dynamic=False,
                                              options=NO_SIZE_ASSERTS)
        else:
            self.decode_step = self._decode_step
            self.prefill_step = self._prefill_step

    def _decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return self.decode_module(tokens, input_pos, live)

    def _prefill_step(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return self.module(tokens, input_pos, live)

    @torch.no_grad()
    def _run(self, tokens, input_pos, live):
        decode = tokens.shape[1] == 1
        fn = self.decode_step if decode else self.prefill_step
        d = self.device
        args = tokens.to(d), input_pos.to(d), live.to(d)
        if not self.compiled:
            return fn(*args)
        if not self.skip_guards:
            return run_batched(fn, *args)
        key = "decode" if decode else "prefill"
        if key not in self._tensors:  # walking the module tree per call would cost ~0.6 ms
            mod = self.decode_module if decode else self.module
            self._tensors[key] = [*mod.parameters(), *mod.buffers()]
        ptrs = [t.data_ptr() for t in self._tensors[key]]  # ~0.02 ms
        if self._checked.get(key) != ptrs:  # first call, or a tensor was replaced: check guards
            out = run_batched(fn, *args)
            self._checked[key] = ptrs
            return out
        with _guards_skipped():
            try:
                return fn(*args)
            except RuntimeError as e:
                # WHY: after torch._dynamo.reset() (or any loss of the compiled step) Dynamo
                # refuses to compile under the skipping stance; it raises before the frame runs,
                # so nothing changed, and a call with the guards checked compiles the step again.
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
        out = run_batched(fn, *args)
        self._checked[key] = ptrs
        return out



def _guards_skipped():
    """`set_stance(skip_guard_eval_unsafe=True)` in whatever stance is current.

    WHY the private `_stance`: `set_stance` sets the stance and the flag together and has no
    getter; entering "default" would silently lift a caller's `fail_on_recompile` or
    `force_eager`. Without it (another torch), guards are simply checked."""
    cur = getattr(torch._dynamo.eval_frame, "_stance", None)
    if cur is None or cur.skip_guard_eval_unsafe:
        return contextlib.nullcontext()
    kw = {"force_backend": cur.backend} if cur.backend is not None else {}
    return torch.compiler.set_stance(cur.stance, skip_guard_eval_unsafe=True, **kw)
