"""The static step: C tokens per row over fixed-shape state (docs/design.md, "The step").

`step` is the single code path of both the decode step (C = 1) and the prefill step
(C = prefill_chunk). It has no Python branch on tensor data, no host read-back, no
data-dependent shape, and writes state only with `index_put` at computed 1-D row indices
(dead tokens and overflowing slots write to sink rows that are never read). With
`inplace=True` it mutates the given buffers (eager, torch.compile, torch.export/ExecuTorch);
with `inplace=False` it returns new tensors instead (a pure function for ONNX, whose exporter
silently drops in-place buffer mutations). Every read of a state tensor happens after its
write, so onnxruntime may alias each output state to its input.
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from .attention import attention_bias, masked_attention, slot_bias
from .reductions import exclusive_cumsum, inclusive_cumsum
from .rope import apply_rope
from .routing import route
from .rows import last_live
from .state import StaticState


def _write(buf: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace:
        return buf.index_put_((rows,), vals)
    return buf.index_put((rows,), vals)


class Shared(NamedTuple):
    """Per-step tensors every layer reads (computed once per step, not per layer)."""

    live: torch.Tensor  # (B, C) bool
    input_pos: torch.Tensor  # (B,) live tokens before the step
    cos_l: torch.Tensor  # (B, 1, C, u) local RoPE rows
    sin_l: torch.Tensor
    ring_rows: torch.Tensor  # (B*H*C,) ring row each local k/v goes to (dead tokens: the sink)
    local_bias: torch.Tensor  # (B, 1, C, R+1) attention bias over the ring and its sink
    local_seen: torch.Tensor  # (B, 1, C, 1) 1.0 where a query sees any ring slot
    main_cos: torch.Tensor | None  # (B, C, 1, u) sparse RoPE rows at token positions
    main_sin: torch.Tensor | None  # (main_sequence; None for semantic_sequence)
    hist_idx: torch.Tensor  # (B, W-1, K) history row (of the row's N+1) of positions input_pos-1 .. -(W-1)
    hist_open: torch.Tensor  # (B, W-1, 1, 1) those positions lie in the open routing block
    route_rows: torch.Tensor  # (B*C,) history row each token's routing goes to (dead tokens: the sink)
    blocks_done: torch.Tensor  # (B, 1) input_pos // W: tokens each expert held at closed blocks
    head_base: torch.Tensor  # (B, 1, 1) b * L, the row's first (b, l) cache head
    ar_l: torch.Tensor  # arange(L)
    slots: torch.Tensor  # (T + 1,) float32 arange(T), then 2**24 at the sink (past every slot: never attended)


class Dims(NamedTuple):
    """Static sizes and flags of a step (Python numbers: the same for every layer)."""

    B: int
    C: int
    H: int
    L: int
    K: int
    u: int
    R: int
    T: int
    local_scale: float
    sparse_scale: float
    inplace: bool
    few: bool  # C <= per_token_max: attend per token (see `step`)


def step(model, state: list[torch.Tensor], tokens: torch.Tensor, input_pos: torch.Tensor,
         live: torch.Tensor, ring: int, inplace: bool, per_token_max: int = 1,
         last_only: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Runs C tokens per row through the model, reading and updating the static state.

    Args:
        model: `ShramForCausalLM`.
        state: the state tensors in `StaticState.names()` order (5 per layer); the routing
            history's rows give N (`StaticState.history`).
        tokens: (B, C) int64 ids (any value at dead tokens).
        input_pos: (B,) int64 live tokens each row has seen before this step.
        live: (B, C) bool, which tokens are live.
        ring: R, slots of the local ring (window + Nr - 1); C must be <= R - window + 1.
        inplace: mutate `state` (True) or return new tensors (False).
        per_token_max: a step of at most this many tokens per row (decode; the compiled verify
            step of speculative decoding) attends each token's K experts through their gathered
            caches and does its chunk arithmetic as fused reductions (`reductions.small_bmm`); a
            longer one (prefill) attends expert by expert (`_attend_by_expert`). The same logits.
            Exported programs use 1: their runtimes copy what a gather picks.
        last_only: logits at each row's last live token only, (B, 1, V) (transformers'
            `logits_to_keep=1`): what a prompt's prefill needs, and the lm_head reads its
            weight for one row instead of C (with a 50k-token vocabulary, the head over 32
            tokens is about half of a chunk's time on CPU).

    Returns:
        logits (B, C, V) (unspecified at dead tokens; (B, 1, V) with `last_only`,
        unspecified for a row without a live token), the new state list, and the selected
        experts (layers, B, C, K), -1 at dead tokens (unused outputs cost nothing in graphs).
    """
    cfg = model.config
    B, C = tokens.shape
    H, L, u = cfg.num_sliding_window_heads, cfg.num_mosrah_heads, cfg.head_dim
    Wn, W, R, T = cfg.window_size, cfg.block_length, ring, cfg.mosrah_cache_length
    dims = Dims(B, C, H, L, cfg.num_selected_heads, u, R, T, 1 / math.sqrt(u),
                model.rope.sparse_factor / math.sqrt(u), inplace, C <= per_token_max)
    if cfg.inference_sequence_length >= 2 ** 24:  # slot numbers are compared in float32 (`slot_bias`)
        raise ValueError(f"inference_sequence_length must be below 2**24, got {cfg.inference_sequence_length}")
    if C > R - Wn + 1:
        raise ValueError(f"a step of {C} tokens needs a ring of at least window + {C} - 1 slots, got {R}")
    N = state[0].shape[0] // B - 1  # routing-history rows per batch row
    dev = tokens.device
    ar_b = torch.arange(B, device=dev)

    # Positions and local-ring bookkeeping, shared by all layers.
    rank = inclusive_cumsum(live, dims.few) - 1  # (B, C)
    pos = input_pos[:, None] + rank.clamp(min=0)  # (B, C) position of each live token
    count = input_pos + live.long().sum(1)  # (B,) live tokens after this step
    cos_l, sin_l = model.rope.local(pos)  # (B, C, u)
    ring_slot = torch.where(live, pos % R, R)  # (B, C), R is the sink
    ring_rows = ((ar_b[:, None, None] * H + torch.arange(H, device=dev)[:, None]) * (R + 1)
                 + ring_slot[:, None, :]).reshape(-1)  # (B*H*C,)
    # Attention runs over all R + 1 rows of a (row, head)'s ring, the sink (j = R) masked: a
    # slice to the first R rows would be a copy of the ring in the XNNPACK delegate.
    j = torch.arange(R + 1, device=dev)
    q_j = (count[:, None] - 1) - (count[:, None] - 1 - j).remainder(R)  # (B, R+1) position in slot j
    dp = pos[:, :, None] - q_j[:, None, :]  # (B, C, R+1)
    local_mask = ((q_j[:, None, :] >= 0) & (dp >= 0) & (dp < Wn) & (j < R))[:, None]  # (B, 1, C, R+1)
    x = model.embed_tokens(tokens)  # (B, C, d)
    dtype = x.dtype  # the embedding may be a quantized table (export.quantize): no .weight
    ar_t = torch.arange(T + 1, device=dev)
    # Routing history: the open block's earlier tokens are positions input_pos - i, i = 1..W-1,
    # those with i <= input_pos % W (a closed block's row is read, then masked). WHY + N and not
    # remainder of a negative number: ExecuTorch's lowered remainder gave -1 there (an index out
    # of range); the operand is >= 0 since N >= W - 1.
    ar_h = torch.arange(1, W, device=dev)  # (W-1,)
    K = cfg.num_selected_heads
    hist_idx = (((input_pos[:, None] - ar_h + N) % N)[:, :, None]
                + torch.zeros(K, dtype=torch.long, device=dev))  # (B, W-1, K), for gather
    hist_open = (ar_h <= (input_pos % W)[:, None])[:, :, None, None]  # (B, W-1, 1, 1)
    route_rows = (ar_b[:, None] * (N + 1) + torch.where(live, pos % N, N)).reshape(-1)  # (B*C,)
    main_cos = main_sin = None
    if cfg.rope_mode == "main_sequence":
        main_cos, main_sin = model.rope.sparse(pos[..., None])  # (B, C, 1, u)
    sh = Shared(live, input_pos, cos_l[:, None], sin_l[:, None], ring_rows,
                attention_bias(local_mask, dtype), local_mask.any(-1, keepdim=True).to(dtype),
                main_cos, main_sin, hist_idx, hist_open, route_rows, (input_pos // W)[:, None],
                (ar_b * L)[:, None, None], torch.arange(L, device=dev),
                torch.where(ar_t < T, ar_t, 2 ** 24).float())

    # WHY the per-layer function is a nested compile region under torch.compile: Inductor then
    # compiles the repeated layer once instead of unrolling every layer into its own C++ (cold
    # compile time scales with depth otherwise). torch.export and the ONNX exporter take the
    # plain function: ExecuTorch's and ONNX's lowering do not take invoke_subgraph.
    run = _layer_step
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        run = _nested_layer_step
    new_state: list[torch.Tensor] = []
    routing: list[torch.Tensor] = []
    for i, layer in enumerate(model.model.layers):
        st = tuple(state[5 * i: 5 * i + 5])
        # Flat positional arguments: Dynamo fingerprints a nested region's call for reuse by
        # tracing pytree's flatten of any tuple argument (3.2 s of a cold bench-model
        # compile), and takes a shortcut when every argument is a tensor, constant or module.
        x, idx, *new = run(layer, model.rope, x, *st, *sh, *dims)
        new_state += new if not inplace else list(st)
        routing.append(idx)
    if last_only:
        at = last_live(live)  # (B,)
        x = x.gather(1, at[:, None, None].expand(B, 1, x.shape[-1]))  # (B, 1, d)
    return model.logits(x), new_state, torch.stack(routing)


def _layer_step(layer, rope, x: torch.Tensor, *flat):
    """One decoder layer over the chunk: (x, its 5 state tensors) -> (x, routing, *new state).

    `flat` is the layer's 5 state tensors, then the fields of `Shared`, then those of `Dims`.

    Returns the new state tensors only when out of place (in place, the inputs were mutated:
    returning them would alias an output to an input, which a nested compile region rejects).
    """
    n = 5 + len(Shared._fields)
    routes, lk, lv, sk, sv = flat[:5]
    sh, dims = Shared(*flat[5:n]), Dims(*flat[n:])
    B, C, H, L, K, u, R, T, local_scale, sparse_scale, inplace, few = dims
    live, input_pos = sh.live, sh.input_pos
    W = L // K  # tokens per routing block
    N = routes.shape[0] // B - 1  # routing-history rows per batch row
    routing = []

    def attn(h: torch.Tensor) -> torch.Tensor:
        nonlocal routes, lk, lv, sk, sv
        # Local path: write the chunk into the ring, then attend over the ring alone.
        la = layer.attention.local_attention
        q, k, v = la.qkv(h)  # (B, H, C, u)
        q, k = apply_rope(q, sh.cos_l, sh.sin_l), apply_rope(k, sh.cos_l, sh.sin_l)
        lk = _write(lk, sh.ring_rows, k.reshape(-1, u), inplace)
        lv = _write(lv, sh.ring_rows, v.reshape(-1, u), inplace)
        kr = lk.view(B, H, R + 1, u)  # (B, H, R+1, u), the sink row masked
        vr = lv.view(B, H, R + 1, u)
        y = la.out(masked_attention(q, kr, vr, sh.local_bias, local_scale, sh.local_seen, few))  # (B, C, d)

        # Sparse path: route, then touch only the K selected experts of each token.
        sa = layer.attention.sparse_attention
        bea = sa.bea
        # Experts taken in the open block, from the history. The read rows are disjoint from
        # the rows this step writes (N >= C + W - 1), and every read feeds the write, so an
        # onnxruntime output aliased to this input is written only after all reads.
        if W > 1:
            # gather, not index_select: a row's few history rows, with no op that the .pte's
            # graph checks flag as a cache gathered per query
            prev = routes.view(B, N + 1, K).gather(1, sh.hist_idx)[..., None]  # (B, W-1, K, 1)
            taken = ((prev == sh.ar_l) & sh.hist_open).view(B, (W - 1) * K, L).any(1)  # (B, L)
        else:  # one token per block: nothing is ever taken
            taken = torch.zeros(B, L, dtype=torch.bool, device=h.device)
        idx, P = route(h, sa.router.routing_weight, live, input_pos, taken, K, few, sa.router.fused)
        routes = _write(routes, sh.route_rows, idx.reshape(B * C, K), inplace)
        routing.append(torch.where(live[..., None], idx, -1))
        held = (sh.blocks_done + taken.long())[:, None, :]  # (B, 1, L) tokens per expert
        hot = None
        if C > 1:  # plus earlier tokens of the chunk (a static shape: there are none at decode)
            chosen = idx.view(B, C, K, 1) == sh.ar_l  # (B, C, K, L), made once per layer
            sel = chosen.any(-2) & live[..., None]  # (B, C, L)
            held = held + exclusive_cumsum(sel, few)  # (B, C, L)
            hot = chosen.to(h.dtype).view(B * C, K, L)  # for `_attend_by_expert` and `bea.select`
        slot = held.gather(-1, idx)  # (B, C, K) index in S_l
        head = sh.head_base + idx  # (B, C, K) row of (b, l) in the cache
        wslot = torch.where(live[..., None] & (slot < T), slot, T)  # T is the sink
        rows = (head * (T + 1) + wslot).reshape(-1)  # (B*C*K,)
        pick = bea.select(idx, hot)  # once per layer: `project` and `output` both take it
        qs, ks, vs = bea.project(h, pick)  # (B, C, K, u)
        # main_sequence: the step's shared rows; semantic_sequence: at the index in S_l (B, C, K, u)
        cos, sin = (sh.main_cos, sh.main_sin) if sh.main_cos is not None else rope.sparse(slot)
        qs, ks = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
        sk = _write(sk, rows, ks.reshape(-1, u), inplace)
        sv = _write(sv, rows, vs.reshape(-1, u), inplace)
        # Every query sees at least slot 0 of its expert (dead ones too): no `seen` multiplier.
        if not few:
            ys = _attend_by_expert(qs, sk, sv, hot, held, sh, dims)
        else:
            hsel = head.reshape(-1)
            kc = sk.view(B * L, T + 1, u).index_select(0, hsel).view(B, C, K, T + 1, u)
            vc = sv.view(B * L, T + 1, u).index_select(0, hsel).view(B, C, K, T + 1, u)
            bias = slot_bias(slot[..., None], sh.slots, qs.dtype)[..., None, :]  # (B, C, K, 1, T+1)
            ys = masked_attention(qs[..., None, :], kc, vc, bias, sparse_scale)[..., 0, :]
        return y + bea.output(ys, P, pick)  # (B, C, d)

    x = layer(x, attn)
    # A flat tuple of tensors: Dynamo reuses a nested region's first trace for the other
    # layers only when its output holds nothing but tensors (a nested `()` made it re-trace
    # every layer).
    return (x, routing[0]) if inplace else (x, routing[0], routes, lk, lv, sk, sv)


_nested_layer_step = torch.compiler.nested_compile_region(_layer_step)


def _attend_by_expert(qs: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, hot: torch.Tensor,
                      held: torch.Tensor, sh: Shared, dims: Dims) -> torch.Tensor:
    """Sparse attention of a chunk (C > 1), one batch per expert: every expert's cache attended
    in place by the chunk's queries, each query kept only at the experts it selected.

    WHY not one gathered cache per query, as at decode: a chunk gathered C*K whole expert caches
    per layer (k and v: 8.5 MB at the bench model's C = 32, K = 4, T = 516), a copy, and
    XNNPACK then packed every gathered v for its bmm. By expert the caches are read where they
    lie; the scores grow L/K-fold (L*C*(T+1) per row), still small beside the linears. At one
    token per row the K gathered caches are fewer bytes than all L, so decode keeps the gather.

    Args:
        qs: (B, C, K, u) queries at the selected experts; sk, sv: (B*L*(T+1), u) written caches.
        hot: (B*C, K, L) the selected experts, one-hot in qs's dtype; held: (B, C, L) the slot
            each token has (or would have) in each expert, the last one it may see.

    Returns:
        (B, C, K, u) attention outputs, as the gathered form gives them.
    """
    B, C, H, L, K, u, R, T, _, scale, _, _ = dims
    # rows move between the K and L layouts as batched matmuls with the one-hot: exact (one 1 per
    # selected row, finite zeros elsewhere) and inside the XNNPACK delegate
    qg = torch.bmm(hot.transpose(1, 2), qs.reshape(B * C, K, u))  # (BC, L, u), 0 where not selected
    qg = qg.view(B, C, L, u).transpose(1, 2)  # (B, L, C, u)
    # cast before the transpose: XNNPACK transposes floats, an int64 one is a portable kernel
    bias = slot_bias(held.float().transpose(1, 2)[..., None], sh.slots, qs.dtype)  # (B, L, C, T+1)
    y = masked_attention(qg, sk.view(B, L, T + 1, u), sv.view(B, L, T + 1, u), bias, scale)  # (B, L, C, u)
    return torch.bmm(hot, y.transpose(1, 2).reshape(B * C, L, u)).view(B, C, K, u)


class StepModule(nn.Module):
    """The in-place step as a module: model weights plus state buffers, for eager,
    torch.compile and torch.export.

    Args:
        model: `ShramForCausalLM`.
        state: its `StaticState`.
        per_token_max: steps of at most this many tokens per row attend per token (`step`).
    """

    def __init__(self, model, state: StaticState, per_token_max: int = 1):
        super().__init__()
        self.model = model
        self.state = state
        self.per_token_max = per_token_max
        self.routing_log: list | None = None  # set to a list to record routing (eager only)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor,
                last_only: bool = False) -> torch.Tensor:
        """tokens (B, C) int64, input_pos (B,) int64, live (B, C) bool -> logits (B, C, V), or
        (B, 1, V) at each row's last live token with `last_only` (`step`)."""
        logits, _, routing = step(self.model, self.state.tensors(), tokens, input_pos, live,
                                  self.state.ring, inplace=True, per_token_max=self.per_token_max,
                                  last_only=last_only)
        if self.routing_log is not None:
            self.routing_log.append(routing)
        return logits


class FunctionalStep(nn.Module):
    """The pure step: state in, state out (for ONNX export).

    Args:
        model: `ShramForCausalLM`.
        state: a `StaticState` giving the ring size and the state order (its buffers are
            not used).
        per_token_max: as in `StepModule`.
        last_only: return the logits at each row's last live token only, (B, 1, V) (`step`).
    """

    def __init__(self, model, state: StaticState, per_token_max: int = 1, last_only: bool = False):
        super().__init__()
        self.model = model
        self.ring = state.ring
        self.names = state.names()
        self.per_token_max = per_token_max
        self.last_only = last_only

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor,
                *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(tokens, input_pos, live, *state) -> (logits, *new_state)."""
        logits, new_state, _ = step(self.model, list(state), tokens, input_pos, live, self.ring, inplace=False,
                                    per_token_max=self.per_token_max, last_only=self.last_only)
        return (logits, *new_state)
