"""Masked softmax attention that is safe on rows with no visible key, on every backend, and the
two forms in which a static step attends the sparse caches (`attend_gathered` over the caches'
prefixes gathered by `prefix_rows` or `prefix_blocks`, or `with_own_rows` in a pure step;
`attend_by_expert`)."""

import torch

from .reductions import small_bmm


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive score bias for `masked_attention`: 0 where `mask` (bool (..., Q, S)) is True,
    finfo(dtype).min / 2 elsewhere (finite: softmax of an all--inf row is NaN).

    WHY a bias, not `where` in the attention: computed once per step for every layer, and the
    per-layer add stays in the XNNPACK delegate (`where` runs on portable kernels)."""
    return torch.where(mask, 0.0, torch.finfo(dtype).min / 2).to(dtype)


def slot_bias(last: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`attention_bias(slots <= last, dtype)`, bit for bit, in float arithmetic.

    WHY: a mask's comparison and `where` run on ExecuTorch's portable kernels; a subtraction, a
    product and a clamp stay in the XNNPACK delegate. The product sends every gap of a slot or
    more past the float range, so the clamp gives exactly 0 or finfo(dtype).min / 2.

    Args:
        last: (..., 1) integer tensor, the last visible slot.
        slots: (S,) float32 slot numbers (integers below 2**24, exact in float32).
        dtype: the scores' dtype; the bias is (..., S).
    """
    gap = last.to(torch.float32) - slots  # (..., S), >= 0 where visible
    return (gap * torch.finfo(torch.float32).max).clamp(min=torch.finfo(dtype).min / 2, max=0.0).to(dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: float, seen: torch.Tensor | None = None, small: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v, with rows that see nothing giving 0.

    Not SDPA: its fully-masked rows give 0 in eager and ExecuTorch but mean(V) in the ONNX export.

    Args:
        q: (..., Q, u); k, v: (..., S, u) with q's leading dims.
        bias: `attention_bias(mask)`, broadcastable to (..., Q, S).
        scale: score scale.
        seen: `mask.any(-1, keepdim=True)` as 1.0/0.0, broadcastable to (..., Q, 1); None when
            every query sees a key.
        small: a few queries (the verify step): both products as `reductions.small_bmm`.

    Returns:
        (..., Q, u).
    """
    *lead, Q, u = q.shape
    S = k.shape[-2]
    # WHY bmm, not `@`: matmul of >2-D operands is expand + bmm, and ExecuTorch runs the expand
    # as a portable copy of the whole cache
    q3, k3, v3 = q.reshape(-1, Q, u), k.reshape(-1, S, u), v.reshape(-1, S, u)  # same leading dims
    mm = small_bmm if small and Q > 1 else torch.bmm  # one query: Inductor fuses the bmm itself
    # WHY q k^T even for one query (k^T is a key copy in XNNPACK): its bmm with a one-column
    # right operand, (k q^T)^T, is slower than copy and product (docs/performance.md, "`.pte`")
    s = mm(q3, k3.transpose(1, 2))  # (N, Q, S)
    s = s.view(*lead, Q, S) * scale + bias  # (..., Q, S)
    a = torch.softmax(s, dim=-1)
    if seen is not None:
        a = a * seen
    return mm(a.reshape(-1, Q, S), v3).view(*lead, Q, u)


def prefix_rows(sk: torch.Tensor, sv: torch.Tensor, head: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first P slots of each query's expert caches, as one gather of just those rows per cache.

    WHY rows: in onnxruntime and ExecuTorch a slice of the caches and a gather are each a copy,
    the slice of all L caches.

    Args:
        sk, sv: (B*L, S, u) every (row, expert) key and value cache, S >= P.
        head: (B, C, K) each query's (row, expert) cache.
        P: slots read per cache.

    Returns:
        keys and values, (B, C, K, P, u) each.
    """
    S, u = sk.shape[1:]
    rows = (head.reshape(-1, 1) * S + torch.arange(P, device=head.device)).reshape(-1)  # (B*C*K*P,)
    return tuple(c.reshape(-1, u).index_select(0, rows).view(*head.shape, P, u) for c in (sk, sv))


def prefix_blocks(sk: torch.Tensor, sv: torch.Tensor, head: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_rows`' values as a gather of whole caches, then their first P slots.

    WHY for Inductor: the gather's index is one per cache, so the kernel loads each slot's u
    values as one vector; by row index it loads them lane by lane, and a step over a long
    context pays for it (docs/performance.md). In an export it would copy K whole caches.

    Args, Returns: as `prefix_rows`.
    """
    u, h = sk.shape[-1], head.reshape(-1)
    return tuple(c.index_select(0, h)[:, :P].view(*head.shape, P, u) for c in (sk, sv))


def with_own_rows(kg: torch.Tensor, vg: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                  wslot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode token's gathered caches, read before the step wrote them, with its own rows put in.

    WHY: in a pure step (state in, state out: the ONNX graphs) whose runtime holds the state and
    takes back only the written rows (the web module), the caches are then read without being
    written, and onnxruntime need not copy them whole to write a few rows (docs/web.md).

    Args:
        kg, vg: (B, 1, K, P, u) the first P slots of the token's K caches before this step.
        ks, vs: (B, 1, K, u) the rows the step writes, at slots `wslot`.
        wslot: (B, 1, K) their slots: below P for a live token; a dead token's (the sink) is
            clamped into its own copies, whose attention nothing reads.

    Returns:
        kg, vg with the rows in, as gathered after the write.
    """
    B, C, K, P, u = kg.shape
    at = torch.arange(B * C * K, device=kg.device) * P + wslot.reshape(-1).clamp(max=P - 1)  # (B*K,)
    return tuple(g.reshape(-1, u).index_put((at,), r.reshape(-1, u)).view(B, C, K, P, u)
                 for g, r in ((kg, ks), (vg, vs)))


def attend_gathered(qs: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor,
                    slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse attention of a few tokens per row over their K experts' gathered caches.

    Args:
        qs: (B, C, K, u) queries at the selected experts.
        kc, vc: (B, C, K, P, u) the first P slots of each query's cache (`prefix_rows`).
        slot: (B, C, K) the last slot each query sees.
        slots: (P,) float32 (`slot_bias`).
        scale: the score scale.

    Returns:
        (B, C, K, u); every query sees slot 0 of its expert, so no `seen` multiplier.
    """
    bias = slot_bias(slot[..., None], slots, qs.dtype)[..., None, :]  # (B, C, K, 1, P)
    return masked_attention(qs[..., None, :], kc, vc, bias, scale)[..., 0, :]


def attend_by_expert(qs: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, hot: torch.Tensor,
                     held: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse attention of a chunk (C > 1), every expert's cache attended in place by the chunk's
    queries, each kept only at its experts. WHY not gathered: C*K gathered caches per layer are
    a large copy; by expert only the scores grow L/K-fold (docs/design.md, "The step").

    Args:
        qs, sk, sv, slots, scale: as in `attend_gathered`.
        hot: (B*C, K, L) the selected experts, one-hot in qs's dtype.
        held: (B, C, L) the slot each token has (or would have) in each expert: the last it sees.

    Returns:
        (B, C, K, u), as `attend_gathered` gives them.
    """
    B, C, K, u = qs.shape
    L, P = hot.shape[-1], slots.shape[0]
    # rows move between the K and L layouts by exact one-hot bmms, inside the XNNPACK delegate
    qg = torch.bmm(hot.transpose(1, 2), qs.reshape(B * C, K, u))  # (BC, L, u), 0 where not selected
    qg = qg.view(B, C, L, u).transpose(1, 2)  # (B, L, C, u)
    # cast before the transpose: XNNPACK transposes floats, an int64 one is a portable kernel
    bias = slot_bias(held.float().transpose(1, 2)[..., None], slots, qs.dtype)  # (B, L, C, P)
    y = masked_attention(qg, sk.view(B, L, P, u), sv.view(B, L, P, u), bias, scale)  # (B, L, C, u)
    return torch.bmm(hot, y.transpose(1, 2).reshape(B * C, L, u)).view(B, C, K, u)
