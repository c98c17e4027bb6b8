"""The static step: C tokens per row over fixed-shape state (docs/design.md, "The step").

`step` is the one code path of the decode step (C = 1) and the prefill step (C = prefill_chunk):
no Python branch on tensor data, no host read-back, no data-dependent shape.
"""

import torch
from torch import nn

from .attention import attention_bias
from .layers import DecoderLayer, StepContext, StepMode
from .reductions import inclusive_cumsum
from .rows import last_live
from .state import StaticState, slot_numbers

# WHY a nested compile region per layer: Inductor compiles the repeated layer once instead of
# once per layer. torch.export and the ONNX exporter take the plain method: ExecuTorch's and
# ONNX's lowering do not take invoke_subgraph.
_layer_step = DecoderLayer.step
_nested_layer_step = torch.compiler.nested_compile_region(DecoderLayer.step)


def step(model, state: list[torch.Tensor], tokens: torch.Tensor, input_pos: torch.Tensor,
         live: torch.Tensor, ring: int, inplace: bool, per_token_max: int = 1,
         last_only: bool = False, slots: torch.Tensor | None = None,
         nested: bool = True, rows_out: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Runs C tokens per row through the model, reading and updating the static state.

    Args:
        model: `ShramForCausalLM`.
        state: the state tensors in `StaticState.names()` order (5 per layer).
        tokens: (B, C) int64 ids (any value at dead tokens).
        input_pos: (B,) int64 live tokens each row has seen before this step.
        live: (B, C) bool, which tokens are live.
        ring: R, slots of the local ring (window + Nr - 1); C must be <= R - window + 1.
        inplace: mutate `state` (True) or return new tensors (False) (`StepMode`).
        per_token_max: a step of at most this many tokens per row attends per token
            (`StepMode.per_token`), a longer one expert by expert.
        last_only: logits at each row's last live token only, (B, 1, V).
        slots: (P,) float32 `slot_numbers(T)[:P]`, the first P slots of each expert's cache
            attended (`state.prefix_len`); None: the whole cache.
        nested: compiled, each layer a nested compile region (False: the layers unrolled).
        rows_out: a pure step (not `inplace`) whose caller keeps only the rows it writes
            (`StepMode.rows_out`: the web site's decode graph).

    Returns:
        logits (B, C, V) (unspecified at dead tokens; (B, 1, V) with `last_only`, unspecified
        for a row without a live token) and the new state list (`state` itself in place).
    """
    cfg = model.config
    B, C = tokens.shape
    if cfg.inference_sequence_length >= 2 ** 24:  # slot numbers are compared in float32 (`slot_bias`)
        raise ValueError(f"inference_sequence_length must be below 2**24, got {cfg.inference_sequence_length}")
    if C > ring - cfg.window_size + 1:
        raise ValueError(f"a step of {C} tokens needs a ring of at least window + {C} - 1 slots, got {ring}")
    mode = StepMode(inplace, C <= per_token_max, rows_out)
    x = model.embed_tokens(tokens)  # (B, C, d)
    ctx = context(model, live, input_pos, ring, state[0].shape[0] // B - 1, mode, x.dtype, slots)
    compiling = torch.compiler.is_compiling() and not torch.compiler.is_exporting()
    run = _nested_layer_step if compiling and nested else _layer_step
    flat = ctx.flat()
    new_state: list[torch.Tensor] = []
    for i, layer in enumerate(model.model.layers):
        st = state[5 * i: 5 * i + 5]
        x, *new = run(layer, x, *st, *flat)
        new_state += new if not inplace else st
    if last_only:
        x = x.gather(1, last_live(live)[:, None, None].expand(B, 1, x.shape[-1]))  # (B, 1, d)
    return model.logits(x), new_state


def context(model, live: torch.Tensor, input_pos: torch.Tensor, ring: int, history: int, mode: StepMode,
            dtype: torch.dtype, slots: torch.Tensor | None = None) -> StepContext:
    """The tensors every layer of a step reads (`StepContext`), once per step; history: N, dtype:
    the hidden states' (a quantized embedding has no .weight to read it from)."""
    cfg = model.config
    B, C = live.shape
    H, L, K = cfg.num_sliding_window_heads, cfg.num_mosrah_heads, cfg.num_selected_heads
    Wn, W, R, T, N = cfg.window_size, cfg.block_length, ring, cfg.mosrah_cache_length, history
    dev = live.device
    ar_b = torch.arange(B, device=dev)
    rank = inclusive_cumsum(live, mode.per_token) - 1  # (B, C)
    pos = input_pos[:, None] + rank.clamp(min=0)  # (B, C) position of each live token
    count = input_pos + live.long().sum(1)  # (B,) live tokens after this step
    # Every field in the shape the layers read it, computed so rather than viewed: WHY: a view of a
    # step-level buffer is a `reinterpret_tensor` in Inductor's wrapper at each layer's call
    cos_l, sin_l = model.rope.local(pos[:, None])  # (B, 1, C, u)
    ring_slot = torch.where(live, pos % R, R)  # (B, C), R is the sink
    ring_rows = ((ar_b[:, None, None] * H + torch.arange(H, device=dev)[:, None]) * (R + 1)
                 + ring_slot[:, None, :])  # (B, H, C)
    j = torch.arange(R + 1, device=dev)  # attention reads all R + 1 rows of a ring, the sink masked
    q_j = (count[:, None] - 1) - (count[:, None] - 1 - j).remainder(R)  # (B, R+1) position in slot j
    dp = pos[:, :, None] - q_j[:, None, :]  # (B, C, R+1)
    local_mask = ((q_j[:, None, :] >= 0) & (dp >= 0) & (dp < Wn) & (j < R))[:, None]  # (B, 1, C, R+1)
    # Routing history: the open block's earlier tokens are positions input_pos - i, i = 1..W-1,
    # those with i <= input_pos % W (a closed block's row is read, then masked). WHY + N and not
    # remainder of a negative number: ExecuTorch's lowered remainder gave -1 there (an index out
    # of range); the operand is >= 0 since N >= W - 1.
    ar_h = torch.arange(1, W, device=dev)  # (W-1,)
    hist_idx = (((input_pos[:, None] - ar_h + N) % N)[:, :, None]
                + torch.zeros(K, dtype=torch.long, device=dev))  # (B, W-1, K), for gather
    hist_open = ar_h.reshape(W - 1, 1, 1) <= (input_pos % W).reshape(B, 1, 1, 1)  # (B, W-1, 1, 1)
    route_rows = ar_b[:, None] * (N + 1) + torch.where(live, pos % N, N)  # (B, C)
    main_cos = main_sin = None
    if cfg.rope_mode == "main_sequence":
        main_cos, main_sin = model.rope.sparse(pos[..., None])  # (B, C, 1, u)
    return StepContext(live, input_pos, cos_l, sin_l, ring_rows,
                       attention_bias(local_mask, dtype), local_mask.any(-1, keepdim=True).to(dtype),
                       main_cos, main_sin, hist_idx, hist_open, route_rows, input_pos[:, None] // W,
                       ar_b[:, None, None] * L, torch.arange(L, device=dev),
                       slot_numbers(T, dev) if slots is None else slots, model.rope, mode)


class StepModule(nn.Module):
    """The in-place step as a module (eager, torch.compile, torch.export).

    Args:
        model: `ShramForCausalLM`.
        state: its `StaticState`.
        per_token_max: steps of at most this many tokens per row attend per token (`step`).
        nested: compiled, each layer a nested compile region (`step`).
    """

    def __init__(self, model, state: StaticState, per_token_max: int = 1, nested: bool = True):
        super().__init__()
        self.model = model
        self.state = state
        self.per_token_max = per_token_max
        self.nested = nested

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor,
                last_only: bool = False, slots: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, C) int64, input_pos (B,) int64, live (B, C) bool -> logits (`step`)."""
        return step(self.model, self.state.tensors(), tokens, input_pos, live, self.state.ring, inplace=True,
                    per_token_max=self.per_token_max, last_only=last_only, slots=slots, nested=self.nested)[0]


class FunctionalStep(nn.Module):
    """The pure step: state in, state out (for ONNX export).

    Args:
        model: `ShramForCausalLM`.
        state: a `StaticState` giving the ring size (not its buffers).
        per_token_max: as in `StepModule`.
        last_only: return the logits at each row's last live token only, (B, 1, V) (`step`).
        prefix: P, the first P sparse slots attended (`step`'s slots); None: all.
        rows_out: its caller keeps only the rows it writes (`step`'s rows_out).
    """

    def __init__(self, model, state: StaticState, per_token_max: int = 1, last_only: bool = False,
                 prefix: int | None = None, rows_out: bool = False):
        super().__init__()
        self.rows_out = rows_out
        # a constant of the exported graph
        self.slots = None if prefix is None else slot_numbers(model.config.mosrah_cache_length)[:prefix]
        self.model = model
        self.ring = state.ring
        self.per_token_max = per_token_max
        self.last_only = last_only

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor,
                *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(tokens, input_pos, live, *state) -> (logits, *new_state)."""
        logits, new_state = step(self.model, list(state), tokens, input_pos, live, self.ring, inplace=False,
                                 per_token_max=self.per_token_max, last_only=self.last_only, slots=self.slots,
                                 rows_out=self.rows_out)
        return (logits, *new_state)
