"""MoSRAH routing: entmax scores and block-balanced top-K selection (docs/design.md, "Routing").

One solver serves the uncached forward, the prefill step (a chunk may start mid-block) and the
decode step, looping over the W = L/K steps of a routing block, not over tokens.
"""

import torch

from .entmax import entmax12
from .reductions import exclusive_cumsum, small_bmm


def top_k(z: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of the k largest of z (..., L), largest first."""
    return z.topk(k, dim=-1).indices


def top_k_ranks(z: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k` by each expert's rank (a tie goes to the lower index) as L x L compares and sums,
    fused by Inductor (`topk` is an aten fallback on CPU). Same indices where the k largest are not tied."""
    ar = torch.arange(z.shape[-1], device=z.device)
    zi, zj = z[..., :, None], z[..., None, :]  # (..., L, 1), (..., 1, L)
    beats = (zj > zi) | ((zj == zi) & (ar < ar[:, None]))  # (..., L, L): expert j ranks before i
    rank = beats.sum(-1)  # (..., L)
    return ((rank[..., None, :] == ar[:k, None]) * ar).sum(-1)  # (..., k)


def block_select(z: torch.Tensor, live: torch.Tensor, start: torch.Tensor, taken: torch.Tensor,
                 k: int, small: bool = False, pick=top_k) -> torch.Tensor:
    """idx (B, C, K) int64 (see `route`): the token at step s of its block of W live tokens takes
    the top-K logits among the experts not taken by steps 0..s-1."""
    B, C, L = z.shape
    if C == 1:
        # WHY a one-token form (a static shape): the block machinery below reduces to a masked
        # top-k, and the exported decode step would run each of its ops as a portable kernel
        return pick(torch.where(taken[:, None], float("-inf"), z), k)  # (B, 1, K)
    W = L // k
    ar = torch.arange(L, device=z.device)
    nb = (W + C - 2) // W + 1  # blocks a chunk of C tokens can touch
    rank = exclusive_cumsum(live, small)  # (B, C) live tokens before each (live) token in the chunk
    mm = small_bmm if small else torch.bmm
    g = (start % W)[:, None] + rank  # frame index, block 0 starting at the carried block's first slot
    blk = (g // W).clamp(0, nb - 1)  # (B, C)
    step = torch.where(blk == 0, rank, g % W)  # solver iteration that handles each token
    blk_oh = (blk[..., None] == torch.arange(nb, device=z.device)).to(z.dtype)  # (B, C, nb)
    taken_blk = torch.cat([taken[:, None].to(z.dtype), z.new_zeros(B, nb - 1, L)], dim=1)  # (B, nb, L)
    idx = torch.zeros(B, C, k, dtype=torch.long, device=z.device)
    for i in range(min(C, W)):
        act = live & (step == i)  # (B, C): at most one token per block
        tk = mm(blk_oh, taken_blk)  # (B, C, L) experts taken in each token's block
        top = pick(torch.where(tk > 0.5, float("-inf"), z), k)  # (B, C, K)
        idx = torch.where(act[..., None], top, idx)
        sel = (top[..., None] == ar).any(-2) & act[..., None]  # (B, C, L)
        taken_blk = taken_blk + mm(blk_oh.transpose(1, 2), sel.to(z.dtype))
    return idx


def route(z: torch.Tensor, live: torch.Tensor, start: torch.Tensor, taken: torch.Tensor, k: int,
          dtype: torch.dtype, small: bool = False, pick=top_k, scores=entmax12) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of one layer from its logits: entmax scores, block-balanced selection and weights.

    Args:
        z: router logits (B, C, L), fp32.
        live: (B, C) bool, live tokens of the chunk.
        start: (B,) int64, live tokens of each row before this chunk.
        taken: (B, L) bool, experts taken in the block open at `start` (all False if none is).
        k: K, experts per token.
        dtype: the weights' dtype (the hidden states').
        small: a chunk of a few tokens (verify): prefix sums and products as fused reductions.
        pick: the top-k function (`top_k`, or `top_k_ranks` for a step compiled by Inductor).
        scores: the entmax (`entmax12`, or `entmax12_unrolled` for a step compiled by Inductor).

    Returns:
        idx: (B, C, K) int64 experts in top-k order (unspecified at dead tokens); P: (B, C, K)
        weights in `dtype`.
    """
    if torch.is_grad_enabled() and z.requires_grad:
        # Training: autograd through `entmax12`'s unrolled Newton steps is not the entmax
        # Jacobian; the `entmax` package's bisection has the exact backward but does not export.
        import entmax
        p = entmax.entmax_bisect(z, alpha=1.2)
    else:
        p = scores(z)
    idx = block_select(z, live, start, taken, k, small, pick)
    ps = p.gather(-1, idx)  # (B, C, K)
    P = ps / ps.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return idx, P.to(dtype)
