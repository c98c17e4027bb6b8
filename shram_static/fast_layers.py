"""Fast-path layers, swapped in for those of `layers.py` on a copy of the model: `row_linear_` for
the compiled steps on CPU (`RowLinear`, `RowExperts`, `FusedRouter`), `fuse_experts_` for the
exported steps (`FusedExperts`). See docs/design.md, "How each backend runs the step"."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .attention import prefix_blocks, prefix_rows
from .entmax import entmax12_unrolled
from .layers import BEA, MoSRAH, Router, gather_experts
from .routing import top_k_ranks

FEW_ROWS = 8  # compiled decode batches up to this size run their projections as RowLinear
LANES = 16  # outputs per block of RowLinear's packed weight


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree sharing every parameter and buffer with `model` (to swap modules on)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


class RowLinear(nn.Module):
    """`nn.Linear` (no bias) for the compiled steps on CPU.

    Up to FEW_ROWS rows, a broadcast product with its own copy of the weight packed in blocks of
    LANES outputs (`pack_rows`), summed in fp32: one contiguous pass, one vector accumulator per
    row. WHY: MKL's GEMV reads the weight well below bandwidth (docs/performance.md, "Compiled
    torch"). More rows go to F.linear. `repack()` after the weight changed.

    Args:
        weight: (out, in), shared with the module it replaces (never changed).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.register_buffer("packed", pack_rows(weight), persistent=False)

    @property
    def sources(self) -> list[torch.Tensor]:
        """The weight the packed copy is made of."""
        return [self.weight]

    def repack(self) -> None:
        """Packs the weight again (into the same buffer where `_refill` can)."""
        _refill(self, "packed", pack_rows(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out) in x's dtype."""
        w = self.weight
        n = x.numel() // x.shape[-1]  # rows
        if n > FEW_ROWS:
            return F.linear(x, w)
        wp = self.packed.float()  # (nb, in, LANES)
        nb, K, v = wp.shape
        xs = x.reshape(n, K).float()  # (n, in)
        y = torch.stack([(xs[r].view(1, K, 1) * wp).sum(1) for r in range(n)])  # (n, nb, LANES)
        y = y.view(n, nb * v)[:, :w.shape[0]]  # (n, out): the last block's padding dropped
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])  # (..., out)


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (ceil(out / LANES), in, LANES): block b holds outputs b*LANES.., zero-padded."""
    N, K = weight.shape
    nb = -(-N // LANES)
    wp = weight.detach().new_zeros(nb * LANES, K)
    wp[:N] = weight.detach()
    return wp.view(nb, LANES, K).transpose(1, 2).contiguous()


class RowExperts(BEA):
    """`BEA` for the compiled steps on CPU, with its own copy of q, k and v side by side (L, d, 3u).

    `project` is `expert_products` over that copy; `prefix` gathers whole caches
    (`attention.prefix_blocks`). `repack()` after a weight changed.

    Args:
        bea: the `BEA` whose weights it shares (not changed).
    """

    prefix = staticmethod(prefix_blocks)  # a slot's values loaded as one vector (`BEA.prefix`: by row)

    def __init__(self, bea: BEA):
        nn.Module.__init__(self)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = bea.q_proj, bea.k_proj, bea.v_proj, bea.o_proj
        self.register_buffer("qkv", self._pack(), persistent=False)

    @property
    def sources(self) -> list[torch.Tensor]:
        """The weights the packed copy is made of."""
        return [self.q_proj, self.k_proj, self.v_proj]

    def _pack(self) -> torch.Tensor:
        return torch.cat([w.detach() for w in self.sources], dim=-1).contiguous()  # (L, d, 3u)

    def repack(self) -> None:
        """Copies the weights again (into the same buffer where `_refill` can)."""
        _refill(self, "qkv", self._pack())

    def project(self, h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See `BEA.project` (`expert_products` over the packed copy)."""
        return expert_products(h, idx, self.qkv)


def expert_products(h: torch.Tensor, idx: torch.Tensor, qkv: torch.Tensor,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of each token's K selected experts from their weights side by side.

    Up to FEW_ROWS tokens per row, each token's K (d, 3u) blocks summed in fp32, vectorized over
    contiguous weights (Inductor loads `BEA.project`'s einsum lane by lane); more (a prefill
    chunk), every expert as one batched matmul and each token's K outputs picked: the weights read
    once per chunk.

    Args:
        h: (B, C, d) normed hidden states.
        idx: (B, C, K) the selected experts.
        qkv: (L, d, 3u) float weights, or int8 ones with `scale`.
        scale: (L, 1, 3u) the int8 weights' scale per expert and output; None for float weights.

    Returns:
        q, k, v, (B, C, K, u) each, in h's dtype.
    """
    B, C, d = h.shape
    if C > FEW_ROWS:
        w = qkv if scale is None else (qkv.float() * scale).to(h.dtype)
        y = torch.matmul(h.reshape(1, B * C, d), w)  # (L, BC, 3u)
        pick = idx.reshape(B * C, -1, 1).expand(-1, -1, y.shape[-1])  # (BC, K, 3u)
        y = y.transpose(0, 1).gather(1, pick).view(B, C, -1, y.shape[-1])  # (B, C, K, 3u)
    else:
        y = (h.float()[:, :, None, :, None] * gather_experts(qkv, idx).float()).sum(-2)  # (B, C, K, 3u)
        if scale is not None:  # after the sum: one product per output, not per weight
            y = y * gather_experts(scale, idx)[..., 0, :]
        y = y.to(h.dtype)
    return qkv_thirds(y)


def qkv_thirds(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(..., 3u) -> its q, k and v thirds, (..., u) each."""
    u = y.shape[-1] // 3
    return y[..., :u], y[..., u:2 * u], y[..., 2 * u:]


def _refill(module: nn.Module, name: str, new: torch.Tensor) -> None:
    """Sets buffer `name` to `new`, in place where it fits (a compiled step keeps reading the old one)."""
    old = getattr(module, name)
    if (new.dtype, new.shape, new.device) == (old.dtype, old.shape, old.device):
        with torch.no_grad():
            old.copy_(new)
    else:
        setattr(module, name, new)


class FusedRouter(Router):
    """`Router` for the compiled steps on CPU over `router`'s weight: logits as row reductions and
    top-k as ranks (`routing.top_k_ranks`), entmax's means and max over single entries
    (`entmax.entmax12_unrolled`): fused into the layer's kernel, no extern mm or topk, no
    reduction loops of their own."""

    pick = staticmethod(top_k_ranks)
    scores = staticmethod(entmax12_unrolled)

    def __init__(self, router: Router):
        nn.Module.__init__(self)
        self.routing_weight = router.routing_weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """See `Router.logits`: rounded to h's dtype as F.linear's output is, then fp32."""
        # one broadcast reduction, not RowLinear's per-row stack: for so small a weight one
        # output buffer beats n row views in the wrapper
        return (h.float()[..., None, :] * self.routing_weight.float()).sum(-1).to(h.dtype).float()


def row_linear_(model: nn.Module) -> nn.Module:
    """Swaps in `RowLinear`, `RowExperts` and `FusedRouter`, in place on a `shared_copy`; returns it."""
    for m in model.modules():
        if isinstance(m, MoSRAH):
            m.router = m.router if isinstance(m.router, FusedRouter) else FusedRouter(m.router)
            m.bea = RowExperts(m.bea) if type(m.bea) is BEA else m.bea
    return swap_linears_(model, RowLinear)


def swap_children_(model: nn.Module, swap) -> nn.Module:
    """Replaces, in place, every submodule `c` of `model` for which `swap(c)` gives a module by that module.

    Args:
        model: a `ShramForCausalLM` copy (never the caller's own model).
        swap: submodule -> its replacement, or None to keep it.

    Returns:
        model.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = swap(child)
            if new is not None:
                setattr(parent, name, new)
    return model


def swap_linears_(model: nn.Module, layer) -> nn.Module:
    """Replaces, in place, every bias-free `nn.Linear` of `model` (and a tied lm_head) by `layer(weight)`.

    Args:
        model: a `ShramForCausalLM` copy (never the caller's own model).
        layer: a module class or factory taking the (out, in) weight.

    Returns:
        model.
    """
    swap_children_(model, lambda c: layer(c.weight) if isinstance(c, nn.Linear) and c.bias is None else None)
    if getattr(model, "lm_head", 0) is None:  # tied: the head reads the embedding table
        model.lm_head = layer(model.embed_tokens.weight)
    return model


class FusedExperts(nn.Module):
    """Expert weights in the exported step's layout, `BEA`'s interface: every expert as one linear
    layer each way, `qkv` (d -> L*3u: q, k, v of expert l at rows l*3u..) and `o` (L*u -> d).
    See docs/design.md, "Why the expert weights have two layouts".

    Args:
        bea: the `BEA` whose weights it takes (copied into the fused layout; not kept).
    """

    def __init__(self, bea: nn.Module):
        super().__init__()
        L, d, u = bea.q_proj.shape
        self.num_experts, self.head_dim = L, u
        qkv = torch.cat([bea.q_proj, bea.k_proj, bea.v_proj], dim=-1)  # (L, d, 3u)
        like = dict(dtype=bea.q_proj.dtype, device=bea.q_proj.device)
        self.qkv = nn.Linear(d, L * 3 * u, bias=False, **like)
        self.o = nn.Linear(L * u, d, bias=False, **like)
        with torch.no_grad():
            self.qkv.weight.copy_(qkv.transpose(1, 2).reshape(L * 3 * u, d))  # row l*3u + j: (q|k|v)_l[:, j]
            self.o.weight.copy_(bea.o_proj.reshape(L * u, d).t())  # column l*u + j: o_proj[l, j]
        self.requires_grad_(False)
        # a constant, not an arange per call (each is a portable op in the exported step)
        self.register_buffer("experts", torch.arange(L, device=like["device"]), persistent=False)

    prefix = staticmethod(prefix_rows)  # see `BEA.prefix`

    def select(self, idx: torch.Tensor, hot: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, C, K) -> one-hot (B*C, K, L) float, made once per layer; `hot`, one already made."""
        if hot is not None:
            return hot
        B, C, K = idx.shape
        # view, not idx[..., None]: outside a delegate a view_copy is free, an unsqueeze_copy a kernel
        hot = idx.view(B, C, K, 1) == self.experts  # (B, C, K, L)
        return hot.to(self.o.weight.dtype).view(B * C, K, self.num_experts)

    def project(self, h: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the selected experts: h (B, C, d), sel (`select`) -> 3 x (B, C, K, u)."""
        B, C, _ = h.shape
        K, u, L = sel.shape[1], self.head_dim, self.num_experts
        y = self.qkv(h).view(B * C, L, 3 * u)  # (BC, L, 3u) every expert
        # selected rows by a one-hot bmm, exact and in the delegate (a gather is a portable copy)
        y = torch.bmm(sel, y).view(B, C, K, 3, u)
        return y[..., 0, :], y[..., 1, :], y[..., 2, :]

    def output(self, y: torch.Tensor, P: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """sum_k P_k y_k o_proj[idx_k]: y (B, C, K, u), P (B, C, K), sel (`select`) -> (B, C, d)."""
        B, C, K, u = y.shape
        # weighted outputs at the token's experts' rows (0 elsewhere), then one linear for all
        z = torch.bmm(sel.transpose(1, 2), (y * P[..., None]).view(B * C, K, u))  # (BC, L, u)
        return self.o(z.view(B, C, self.num_experts * u))

    def project_all(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See `BEA.project_all`."""
        B, N, _ = h.shape
        y = self.qkv(h).view(B, N, self.num_experts, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # (3, B, L, N, u)
        return y[0], y[1], y[2]

    def output_all(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """See `BEA.output_all`."""
        B, L, N, u = y.shape
        return self.o((y * w.transpose(1, 2)[..., None]).transpose(1, 2).reshape(B, N, L * u))


def fuse_experts_(model: nn.Module) -> nn.Module:
    """Replaces every `BEA` of `model` (a copy that owns its weights) by a `FusedExperts`, in place;
    returns `model`."""
    for m in model.modules():
        if isinstance(m, MoSRAH) and not isinstance(m.bea, FusedExperts):
            m.bea = FusedExperts(m.bea)
    return model
