"""MoSRAH routing: entmax scores and block-balanced top-K selection (docs/design.md, "Routing").

One solver serves the uncached forward (a whole sequence from position 0), the prefill step
(a chunk that may start mid-block, carrying the experts already taken) and the decode step
(a chunk of one token). It has no per-token Python loop: it loops over the W = L/K steps of
a routing block (a static Python int), handling the same step of every block at once.
"""

import torch

from .entmax import entmax12
from .reductions import exclusive_cumsum, small_bmm


def top_k(z: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of the k largest of z (..., L), largest first."""
    return z.topk(k, dim=-1).indices


def top_k_ranks(z: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k` by counting each expert's rank (the experts that beat it, a tie going to the lower
    index) and picking ranks 0..k-1: compares and sums over L x L, which Inductor fuses into the
    layer's kernel. WHY: `topk` is an aten fallback on CPU, a call out of the fused kernel per use
    (one per layer at decode, W per layer at verify) with its own allocations. Same indices as
    `top_k` wherever the k largest are not tied."""
    ar = torch.arange(z.shape[-1], device=z.device)
    zi, zj = z[..., :, None], z[..., None, :]  # (..., L, 1), (..., 1, L)
    beats = (zj > zi) | ((zj == zi) & (ar < ar[:, None]))  # (..., L, L): expert j ranks before i
    rank = beats.sum(-1)  # (..., L)
    return ((rank[..., None, :] == ar[:k, None]) * ar).sum(-1)  # (..., k)


def block_select(z: torch.Tensor, live: torch.Tensor, start: torch.Tensor, taken: torch.Tensor,
                 k: int, small: bool = False, pick=top_k) -> torch.Tensor:
    """Block-balanced selection of K experts per live token.

    A row's live tokens form blocks of W = L/K tokens counted from the row's first live
    token. The token at step s of its block takes the top-K logits among the experts not
    taken by steps 0..s-1 of the same block.

    Args:
        z: router logits (B, C, L), fp32.
        live: (B, C) bool, live tokens of the chunk.
        start: (B,) int64, live tokens of each row before this chunk.
        taken: (B, L) bool, experts taken in the block that is open at `start` (the caller
            passes all False when `start % W == 0`: no block is open then).
        k: K, experts per token.
        small: a chunk of a few tokens (the verify step): its prefix sums and block products as
            fused reductions (`reductions.small_bmm`), the same selection.
        pick: the top-k function (`top_k`, or `top_k_ranks` for a step compiled by Inductor).

    Returns:
        idx: (B, C, K) int64 experts in top-k order (unspecified at dead tokens). The experts
        taken after the chunk are not returned: the static state derives them from its routing
        history (`state.py`).
    """
    B, C, L = z.shape
    if C == 1:
        # WHY a one-token form (a static shape, not a data branch): one token is step
        # `start % W` of its block, so it takes the top-K of the experts not yet taken, and the
        # block machinery below (cumsum, block one-hots, three bmm) reduces to a masked top-k.
        # The exported decode step runs every one of those ops as a portable kernel per layer.
        return pick(torch.where(taken[:, None], float("-inf"), z), k)  # (B, 1, K)
    W = L // k
    ar = torch.arange(L, device=z.device)
    nb = (W + C - 2) // W + 1  # blocks a chunk of C tokens can touch
    rank = exclusive_cumsum(live, small)  # (B, C) live tokens before each (live) token in the chunk
    mm = small_bmm if small else torch.bmm
    off = (start % W)[:, None]  # (B, 1)
    g = off + rank  # frame index, block 0 starting at the carried block's first slot
    blk = (g // W).clamp(0, nb - 1)  # (B, C)
    step = torch.where(blk == 0, rank, g % W)  # solver iteration that handles each token
    blk_oh = (blk[..., None] == torch.arange(nb, device=z.device)).to(z.dtype)  # (B, C, nb)
    taken_blk = torch.cat([taken[:, None].to(z.dtype),
                           z.new_zeros(B, nb - 1, L)], dim=1)  # (B, nb, L)
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
          dtype: torch.dtype, small: bool = False, pick=top_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of one layer from its logits: entmax scores, block-balanced selection and weights.

    Args:
        z: router logits (B, C, L), fp32.
        live, start, taken, k, small, pick: as in `block_select`.
        dtype: the weights' dtype (the hidden states').

    Returns:
        idx: (B, C, K) selected experts; P: (B, C, K) weights in `dtype`.
    """
    if torch.is_grad_enabled() and z.requires_grad:
        # Training: `entmax12` is a fixed number of Newton steps whose autograd differentiates
        # the unrolled steps (through clamps and a starting point set by max(z)), not the
        # entmax Jacobian, so the router would get an approximate gradient. The `entmax`
        # package's bisection has the exact closed-form backward, but it is a custom
        # autograd.Function of 50 sequential halvings that the exporters do not take, so
        # inference (and every export) keeps `entmax12`; same forward values.
        import entmax
        scores = entmax.entmax_bisect(z, alpha=1.2)
    else:
        scores = entmax12(z)
    idx = block_select(z, live, start, taken, k, small, pick)
    ps = scores.gather(-1, idx)  # (B, C, K)
    P = ps / ps.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return idx, P.to(dtype)
