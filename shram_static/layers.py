"""The modules of one SHRAM decoder layer, named as in the checkpoint, and their static step over
their own caches, reading a `StepContext` (docs/design.md, "Checkpoint layout", "The step")."""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend_by_expert, attend_gathered, masked_attention, prefix_rows, with_own_rows
from .config import ShramConfig
from .entmax import entmax12
from .reductions import exclusive_cumsum, mean_last
from .rope import apply_rope
from .routing import route, top_k
from .state import write_rows


class StepMode(NamedTuple):
    """How a static step runs, fixed for each compiled graph or exported program."""

    inplace: bool  # write the state buffers in place (False: return new ones, for ONNX)
    # a few tokens per row (decode, verify): gathered caches and fused reductions; else by expert
    per_token: bool
    # a pure step whose runtime takes back only the written rows (the web graphs): a decode step
    # reads its caches as passed in, its own rows put in (`with_own_rows`)
    rows_out: bool = False


class StepContext(NamedTuple):
    """What every layer of one static step reads, computed once per step (`step.step`).

    B rows of C tokens; H local heads, L experts, K selected, u head width, R ring slots,
    T sparse slots, W = L/K tokens per routing block."""

    live: torch.Tensor  # (B, C) bool
    input_pos: torch.Tensor  # (B,) live tokens before the step
    cos_l: torch.Tensor  # (B, 1, C, u) local RoPE rows
    sin_l: torch.Tensor
    ring_rows: torch.Tensor  # (B, H, C) ring row each local k/v goes to (dead tokens: the sink)
    local_bias: torch.Tensor  # (B, 1, C, R+1) attention bias over the ring and its sink
    local_seen: torch.Tensor  # (B, 1, C, 1) 1.0 where a query sees any ring slot
    main_cos: torch.Tensor | None  # (B, C, 1, u) sparse RoPE rows at token positions
    main_sin: torch.Tensor | None  # (main_sequence; None for semantic_sequence)
    hist_idx: torch.Tensor  # (B, W-1, K) history row (of the row's N+1) of positions input_pos-1 .. -(W-1)
    hist_open: torch.Tensor  # (B, W-1, 1, 1) those positions lie in the open routing block
    route_rows: torch.Tensor  # (B, C) history row each token's routing goes to (dead tokens: the sink)
    blocks_done: torch.Tensor  # (B, 1) input_pos // W: tokens each expert held at closed blocks
    head_base: torch.Tensor  # (B, 1, 1) b * L, the row's first (b, l) cache head
    ar_l: torch.Tensor  # arange(L)
    # (P,) float32 sparse slots attended, arange(P), P >= every row's live slots (`prefix_len`);
    # at P = T + 1 the sink too, numbered 2**24 (never attended)
    slots: torch.Tensor
    rope: nn.Module  # the model's `RotaryTables` (semantic_sequence: sparse rows at each slot)
    mode: StepMode

    def flat(self) -> tuple:
        """The fields with the mode's spread out: what `DecoderLayer.step` takes after its state."""
        return (*self[:-1], *self.mode)

    @classmethod
    def of(cls, flat: tuple) -> "StepContext":
        """The context whose `flat()` is `flat`."""
        return cls(*flat[:-len(StepMode._fields)], StepMode(*flat[-len(StepMode._fields):]))


def gather_experts(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Weights of the selected experts: w (L, a, b), idx (B, C, K) -> (B, C, K, a, b).

    A 1-D index_select, not `w[idx]`: ExecuTorch runs that as an element-wise portable index."""
    return w.index_select(0, idx.reshape(-1)).view(*idx.shape, *w.shape[1:])


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(mean_last(xf * xf) + self.eps)  # mean_last: stays in XNNPACK
        return self.weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LocalAttention(nn.Module):
    """Sliding-window multi-head attention weights: H heads of width u."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        d, hu = config.embedding_width, config.num_sliding_window_heads * config.head_dim
        self.num_heads, self.head_dim = config.num_sliding_window_heads, config.head_dim
        self.q_proj = nn.Linear(d, hu, bias=False)
        self.k_proj = nn.Linear(d, hu, bias=False)
        self.v_proj = nn.Linear(d, hu, bias=False)
        self.o_proj = nn.Linear(hu, d, bias=False)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, C, d) -> q, k, v each (B, H, C, u)."""
        B, C, _ = h.shape
        split = lambda proj: proj(h).view(B, C, self.num_heads, self.head_dim).transpose(1, 2)
        return split(self.q_proj), split(self.k_proj), split(self.v_proj)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, C, u) -> (B, C, d)."""
        B, H, C, u = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, C, H * u))

    def step(self, h: torch.Tensor, local_k: torch.Tensor, local_v: torch.Tensor,
             ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Writes the chunk's k, v into the ring (B*H*(R+1), u), attends it: h (B, C, d) normed -> y, k, v."""
        B, u = h.shape[0], self.head_dim
        q, k, v = self.qkv(h)  # (B, H, C, u)
        q, k = apply_rope(q, ctx.cos_l, ctx.sin_l), apply_rope(k, ctx.cos_l, ctx.sin_l)
        rows = ctx.ring_rows.reshape(-1)  # (B*H*C,)
        local_k = write_rows(local_k, rows, k.reshape(-1, u), ctx.mode.inplace)
        local_v = write_rows(local_v, rows, v.reshape(-1, u), ctx.mode.inplace)
        # all R + 1 rows, the sink masked: a slice to R rows is a copy in the XNNPACK delegate
        kr, vr = (c.view(B, self.num_heads, -1, u) for c in (local_k, local_v))  # (B, H, R+1, u)
        y = masked_attention(q, kr, vr, ctx.local_bias, 1 / math.sqrt(u), ctx.local_seen, ctx.mode.per_token)
        return self.out(y), local_k, local_v


class Router(nn.Module):
    """The MoSRAH router's weight (L, d): its logits and top-k (`FusedRouter` in compiled steps)."""

    pick = staticmethod(top_k)
    scores = staticmethod(entmax12)

    def __init__(self, config: ShramConfig):
        super().__init__()
        self.routing_weight = nn.Parameter(torch.empty(config.num_mosrah_heads, config.embedding_width))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, C, d) -> (B, C, L) fp32; linear, as XNNPACK delegates it."""
        return F.linear(h, self.routing_weight).float()

    def forward(self, h: torch.Tensor, live: torch.Tensor, start: torch.Tensor, taken: torch.Tensor, k: int,
                small: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, P) each (B, C, K) for normed hidden states h (B, C, d): `routing.route`."""
        return route(self.logits(h), live, start, taken, k, h.dtype, small, self.pick, self.scores)


class BEA(nn.Module):
    """Expert-head weights of the sparse path: one (d, u) matrix per expert and projection."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        L, d, u = config.num_mosrah_heads, config.embedding_width, config.head_dim
        self.q_proj = nn.Parameter(torch.empty(L, d, u))
        self.k_proj = nn.Parameter(torch.empty(L, d, u))
        self.v_proj = nn.Parameter(torch.empty(L, d, u))
        self.o_proj = nn.Parameter(torch.empty(L, u, d))

    # the first P slots of each query's caches: sk, sv (B*L, S, u), head (B, C, K), P -> 2 x (B, C, K, P, u)
    prefix = staticmethod(prefix_rows)

    def select(self, idx: torch.Tensor, hot: torch.Tensor | None = None) -> torch.Tensor:
        """The selection `project` and `output` take: idx (B, C, K) itself (`hot` is unused here)."""
        return idx

    def project(self, h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the selected experts: h (B, C, d), idx (`select`: B, C, K) -> 3 x (B, C, K, u)."""
        return tuple(torch.einsum("bcd,bckdu->bcku", h, gather_experts(w, idx))
                     for w in (self.q_proj, self.k_proj, self.v_proj))

    def dense_weights(self) -> tuple[torch.Tensor, ...]:
        """Every expert's q, k, v (L, d, u) and o (L, u, d) weights as the uncached forward
        multiplies them (a quantized subclass: dequantized)."""
        return self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def project_all(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of every expert (the uncached forward): h (B, N, d) -> 3 x (B, L, N, u)."""
        return tuple(torch.einsum("bnd,ldu->blnu", h, w.to(h.dtype)) for w in self.dense_weights()[:3])

    def output_all(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every expert's outputs y (B, L, N, u) mixed by w (B, N, L) -> (B, N, d)."""
        return torch.einsum("blnu,lud,bnl->bnd", y, self.dense_weights()[3].to(y.dtype), w)

    def output_blocks(self, idx: torch.Tensor) -> torch.Tensor:
        """Each token's K o_proj blocks: idx (B, C, K) -> (B, C, K, u, d)."""
        return gather_experts(self.o_proj, idx)

    def output(self, y: torch.Tensor, P: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """sum_k P_k y_k o_proj[idx_k]: y (B, C, K, u), P (B, C, K), idx (`select`) -> (B, C, d)."""
        B, C, K, u = y.shape
        wo = self.output_blocks(idx).to(y.dtype).view(B * C, K * u, -1)  # (BC, K*u, d)
        return torch.bmm((y * P[..., None]).reshape(B * C, 1, K * u), wo).view(B, C, -1)


class MoSRAH(nn.Module):
    """The sparse path: a router and L expert heads, K of them selected per token."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        self.router = Router(config)
        self.bea = BEA(config)
        self.num_experts, self.num_selected = config.num_mosrah_heads, config.num_selected_heads
        self.head_dim = config.head_dim

    def step(self, h: torch.Tensor, routes: torch.Tensor, sparse_k: torch.Tensor, sparse_v: torch.Tensor,
             ctx: StepContext) -> tuple[torch.Tensor, ...]:
        """Routes the chunk, writes each token's k, v into its K experts' caches, attends them, mixes
        by P: h (B, C, d) normed, routes (B*(N+1), K), sparse_k, sparse_v (B*L*(T+1), u) -> y and those."""
        B, C, _ = h.shape
        L, K, u, mode = self.num_experts, self.num_selected, self.head_dim, ctx.mode
        W, N, T = L // K, routes.shape[0] // B - 1, sparse_k.shape[0] // (B * L) - 1
        # Experts taken in the open block, from history rows disjoint from those this step writes
        # (N >= C + W - 1), read before the write: an aliased onnxruntime output is safe.
        if W > 1:
            # gather, not index_select: the .pte's graph checks flag the latter as a cache gather
            prev = routes.view(B, N + 1, K).gather(1, ctx.hist_idx)[..., None]  # (B, W-1, K, 1)
            taken = ((prev == ctx.ar_l) & ctx.hist_open).view(B, (W - 1) * K, L).any(1)  # (B, L)
        else:  # one token per block: nothing is ever taken
            taken = torch.zeros(B, L, dtype=torch.bool, device=h.device)
        idx, P = self.router(h, ctx.live, ctx.input_pos, taken, K, mode.per_token)
        routes = write_rows(routes, ctx.route_rows.reshape(-1), idx.reshape(B * C, K), mode.inplace)
        held = (ctx.blocks_done + taken.long())[:, None, :]  # (B, 1, L) tokens per expert
        hot = None
        if C > 1:  # plus earlier tokens of the chunk (a static shape: there are none at decode)
            chosen = idx.view(B, C, K, 1) == ctx.ar_l  # (B, C, K, L), made once per layer
            sel = chosen.any(-2) & ctx.live[..., None]  # (B, C, L)
            held = held + exclusive_cumsum(sel, mode.per_token)  # (B, C, L)
            hot = chosen.to(h.dtype).view(B * C, K, L)  # for `attend_by_expert` and `bea.select`
        slot = held.gather(-1, idx)  # (B, C, K) index in S_l
        head = ctx.head_base + idx  # (B, C, K) row of (b, l) in the cache
        wslot = torch.where(ctx.live[..., None] & (slot < T), slot, T)  # T is the sink
        rows = (head * (T + 1) + wslot).reshape(-1)  # (B*C*K,)
        pick = self.bea.select(idx, hot)  # once per layer: `project` and `output` both take it
        qs, ks, vs = self.bea.project(h, pick)  # (B, C, K, u)
        # main_sequence: the step's shared rows; semantic_sequence: at the index in S_l (B, C, K, u)
        cos, sin = (ctx.main_cos, ctx.main_sin) if ctx.main_cos is not None else ctx.rope.sparse(slot)
        qs, ks = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
        before = (sparse_k, sparse_v) if mode.rows_out and C == 1 else None  # `StepMode.rows_out`
        sparse_k = write_rows(sparse_k, rows, ks.reshape(-1, u), mode.inplace)
        sparse_v = write_rows(sparse_v, rows, vs.reshape(-1, u), mode.inplace)
        scale = ctx.rope.sparse_factor / math.sqrt(u)
        kc, vc = (c.view(B * L, T + 1, u) for c in (before or (sparse_k, sparse_v)))
        if mode.per_token:  # the first P slots of each token's K caches, gathered
            kv = self.bea.prefix(kc, vc, head, ctx.slots.shape[0])
            if before is not None:
                kv = with_own_rows(*kv, ks, vs, wslot)
            ys = attend_gathered(qs, *kv, slot, ctx.slots, scale)
        else:
            # the first P slots of each cache (`StepContext.slots`); not sliced in an export of the
            # whole cache (a copy in ExecuTorch), and no test of P under Dynamo (a dynamic size)
            n = ctx.slots.shape[0]
            if not torch.compiler.is_exporting() or n < T + 1:
                kc, vc = kc[:, :n], vc[:, :n]
            ys = attend_by_expert(qs, kc, vc, hot, held, ctx.slots, scale)
        return self.bea.output(ys, P, pick), routes, sparse_k, sparse_v


class HybridAttention(nn.Module):
    def __init__(self, config: ShramConfig):
        super().__init__()
        self.local_attention = LocalAttention(config)
        self.sparse_attention = MoSRAH(config)


class DecoderLayer(nn.Module):
    """One layer: a = x + g_attn * attn(norm(x)); x = a + g_mlp * mlp(norm(a)) (`residual`)."""

    def __init__(self, config: ShramConfig):
        super().__init__()
        d = config.embedding_width
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.mlp_norm = RMSNorm(d, config.rms_norm_eps)
        self.attention = HybridAttention(config)
        self.mlp = SwiGLU(d, config.mlp_width)
        for name in ("attn_residual_scale", "mlp_residual_scale"):
            if config.use_residual_gate:
                self.register_parameter(name, nn.Parameter(torch.ones(1)))
            else:
                self.register_buffer(name, torch.full((1,), 1.0 / math.sqrt(config.num_decoder_layers)))

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The layer's output for its input x and attention output y = attn(attn_norm(x))."""
        a = x + self.attn_residual_scale * y
        return a + self.mlp_residual_scale * self.mlp(self.mlp_norm(a))

    def step(self, x: torch.Tensor, routes: torch.Tensor, local_k: torch.Tensor, local_v: torch.Tensor,
             sparse_k: torch.Tensor, sparse_v: torch.Tensor, *ctx) -> tuple[torch.Tensor, ...]:
        """The layer over a chunk of the static step, reading and writing its 5 state tensors.

        Args: x (B, C, d); routes .. sparse_v (`state.LayerState`); ctx `StepContext.flat()`.
        Returns: (x,) in place, (x, *the new state) out of place: a flat tuple (what Dynamo reuses a
            region's trace for), without mutated inputs (a region rejects an output aliasing one).
        """
        ctx = StepContext.of(ctx)
        h = self.attn_norm(x)
        y, local_k, local_v = self.attention.local_attention.step(h, local_k, local_v, ctx)
        ys, routes, sparse_k, sparse_v = self.attention.sparse_attention.step(h, routes, sparse_k, sparse_v, ctx)
        x = self.residual(x, y + ys)
        return (x,) if ctx.mode.inplace else (x, routes, local_k, local_v, sparse_k, sparse_v)
