"""Masked softmax attention that is safe on rows with no visible key, on every backend, and the
two forms in which a static step attends the sparse caches (`attend_gathered`, `attend_by_expert`)."""

import torch

from .reductions import small_bmm


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive score bias for `masked_attention`: 0 where `mask` (bool (..., Q, S)) is True,
    finfo(dtype).min / 2 elsewhere (finite, not -inf: softmax of an all--inf row is NaN, and
    NaN * 0 stays NaN).

    WHY a bias instead of `where(mask, s, -inf)` inside the attention: a step computes the local
    path's bias once and every layer reuses it, and the per-layer add stays inside the XNNPACK
    delegate (`where` and comparisons run on ExecuTorch's portable kernels and split it).
    """
    return torch.where(mask, 0.0, torch.finfo(dtype).min / 2).to(dtype)


def slot_bias(last: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`attention_bias(slots <= last, dtype)`, bit for bit, in float arithmetic.

    WHY: the comparison and `where` of a mask run on ExecuTorch's portable kernels, which take
    ~1 ns per element with broadcasting (a prefill chunk's per-layer sparse mask is L*C*(T+1)
    elements); a subtraction, a product and a clamp stay in the XNNPACK delegate. The product
    sends every gap of at least one slot past the float range, so the clamp gives exactly 0 or
    finfo(dtype).min / 2 (no NaN: the gaps are finite, and 0 * max is 0).

    Args:
        last: (..., 1) integer tensor, the last visible slot.
        slots: (S,) float32 slot numbers (integers below 2**24, exact in float32).
        dtype: the scores' dtype.

    Returns:
        (..., S) bias: 0 where slots <= last, finfo(dtype).min / 2 elsewhere.
    """
    gap = last.to(torch.float32) - slots  # (..., S), >= 0 where visible
    big = torch.finfo(torch.float32).max
    return (gap * big).clamp(min=torch.finfo(dtype).min / 2, max=0.0).to(dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: float, seen: torch.Tensor | None = None, small: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v, with rows that see nothing giving 0.

    Explicit matmul + masked softmax rather than SDPA: SDPA's fully-masked rows give 0 in
    eager/ExecuTorch but mean(V) in the ONNX export (TOOLCHAIN_NOTES), and neither backend has
    a fused attention kernel to gain.

    Args:
        q: (..., Q, u); k, v: (..., S, u) with q's leading dims.
        bias: `attention_bias(mask)`, broadcastable to (..., Q, S).
        seen: `mask.any(-1, keepdim=True)` as 1.0/0.0, broadcastable to (..., Q, 1), zeroing
            rows that see no key; None when every query sees at least one key.
        scale: score scale.
        small: a few queries (the verify step): both products as `reductions.small_bmm`.

    Returns:
        (..., Q, u).
    """
    *lead, Q, u = q.shape
    S = k.shape[-2]
    # WHY bmm over flattened leading dims, not `@`: matmul of >2-D operands decomposes into
    # expand + bmm, and ExecuTorch runs each expand as a portable copy of the whole cache
    # (its XNNPACK partitioner does not take expand_copy).
    q3, k3, v3 = q.reshape(-1, Q, u), k.reshape(-1, S, u), v.reshape(-1, S, u)  # same leading dims
    mm = small_bmm if small and Q > 1 else torch.bmm  # one query: Inductor fuses the bmm itself
    # WHY q k^T even for one query, though k^T is a copy of the keys in the XNNPACK delegate (its
    # bmm has no transposed operand): the other way round, (k q^T)^T copies only the Q*S
    # scores, but XNNPACK's bmm with a one-column right operand took twice as long as the key
    # copy and this product together (the bench model's decode attention alone 0.97 -> 0.57 ms;
    # its `.pte` decode step 0.96-0.98x fp32, 0.94-0.98x int8; Inductor's code is the same
    # either way: docs/performance.md, "`.pte`").
    s = mm(q3, k3.transpose(1, 2))  # (N, Q, S)
    s = s.view(*lead, Q, S) * scale + bias  # (..., Q, S)
    a = torch.softmax(s, dim=-1)
    if seen is not None:
        a = a * seen
    return mm(a.reshape(-1, Q, S), v3).view(*lead, Q, u)


def attend_gathered(qs: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, head: torch.Tensor,
                    slot: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse attention of a few tokens per row, each token's K expert caches gathered: qs
    (B, C, K, u) at the selected experts, sk, sv (B*L, P, u) the first P slots of every (row,
    expert) cache (written), head (B, C, K) each one's (row, expert) cache, slot (B, C, K) the
    last slot it sees there, slots (P,) float32 slot numbers (`slot_bias`) -> (B, C, K, u).
    Every query sees at least slot 0 of its expert: no `seen` multiplier."""
    B, C, K, u = qs.shape
    P = slots.shape[0]
    hsel = head.reshape(-1)
    kc = sk.index_select(0, hsel).view(B, C, K, P, u)
    vc = sv.index_select(0, hsel).view(B, C, K, P, u)
    bias = slot_bias(slot[..., None], slots, qs.dtype)[..., None, :]  # (B, C, K, 1, P)
    return masked_attention(qs[..., None, :], kc, vc, bias, scale)[..., 0, :]


def attend_by_expert(qs: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, hot: torch.Tensor,
                     held: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse attention of a chunk (C > 1), one batch per expert: every expert's cache attended
    in place by the chunk's queries, each query kept only at the experts it selected.

    WHY not one gathered cache per query, as at decode: a chunk gathered C*K whole expert caches
    per layer (k and v: 8.5 MB at the bench model's C = 32, K = 4, T = 516), a copy, and
    XNNPACK then packed every gathered v for its bmm. By expert the caches are read where they
    lie; the scores grow L/K-fold (L*C*(T+1) per row), still small beside the linears. At one
    token per row the K gathered caches are fewer bytes than all L, so decode keeps the gather.

    Args:
        qs: (B, C, K, u) queries at the selected experts; sk, sv: (B*L, P, u) the first P slots
            of every (row, expert) cache, written.
        hot: (B*C, K, L) the selected experts, one-hot in qs's dtype; held: (B, C, L) the slot
            each token has (or would have) in each expert, the last one it may see; slots, scale:
            as in `attend_gathered`.

    Returns:
        (B, C, K, u) attention outputs, as `attend_gathered` gives them.
    """
    B, C, K, u = qs.shape
    L, P = hot.shape[-1], slots.shape[0]
    # rows move between the K and L layouts as batched matmuls with the one-hot: exact (one 1 per
    # selected row, finite zeros elsewhere) and inside the XNNPACK delegate
    qg = torch.bmm(hot.transpose(1, 2), qs.reshape(B * C, K, u))  # (BC, L, u), 0 where not selected
    qg = qg.view(B, C, L, u).transpose(1, 2)  # (B, L, C, u)
    # cast before the transpose: XNNPACK transposes floats, an int64 one is a portable kernel
    bias = slot_bias(held.float().transpose(1, 2)[..., None], slots, qs.dtype)  # (B, L, C, P)
    y = masked_attention(qg, sk.view(B, L, P, u), sv.view(B, L, P, u), bias, scale)  # (B, L, C, u)
    return torch.bmm(hot, y.transpose(1, 2).reshape(B * C, L, u)).view(B, C, K, u)
