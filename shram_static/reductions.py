"""Row reductions in the one form XNNPACK delegates.

ExecuTorch's XNNPACK partitioner takes `mean.dim` only over the two innermost dims of a 4-D
tensor with keepdim, and leaves other `sum`/`mean` shapes and `amax` on portable kernels, each
of which splits the delegate. Viewing (..., n) as (-1, 1, 1, n) keeps entmax's Newton steps and
RMSNorm inside the delegate; a max is a tree of elementwise `maximum`s over halves.
"""

import torch


def mean_last(y: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, kept: (..., n) -> (..., 1)."""
    n = y.shape[-1]
    return y.reshape(-1, 1, 1, n).mean(dim=(2, 3), keepdim=True).reshape(*y.shape[:-1], 1)


def max_last(y: torch.Tensor) -> torch.Tensor:
    """Max over the last dim, kept: (..., n) -> (..., 1), as ceil(log2 n) elementwise maximums
    of halves (slices, `maximum` and `cat` all stay in XNNPACK; `amax` would not)."""
    while y.shape[-1] > 1:
        h = y.shape[-1] // 2
        m = torch.maximum(y[..., :h], y[..., h:2 * h])
        y = torch.cat([m, y[..., 2 * h:]], dim=-1) if y.shape[-1] % 2 else m
    return y


def fold_entries(y: torch.Tensor, op) -> torch.Tensor:
    """`op` folded over the last dim's entries, kept: (..., n) -> (..., 1), as n - 1 elementwise
    `op`s of single entries, pairwise. For a few entries (a router's experts): n slices.

    WHY for Inductor: ops on single entries fuse into the loop of what reads the result, where a
    reduction is a loop nest of its own, and its result a buffer the wrapper allocates on every
    call (docs/performance.md)."""
    parts = [y[..., i:i + 1] for i in range(y.shape[-1])]
    while len(parts) > 1:
        parts = [op(a, b) for a, b in zip(parts[::2], parts[1::2])] + parts[len(parts) // 2 * 2:]
    return parts[0]


def mean_unrolled(y: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, kept, as `fold_entries`' sum."""
    return fold_entries(y, torch.add) / y.shape[-1]


def max_unrolled(y: torch.Tensor) -> torch.Tensor:
    """Max over the last dim, kept, as `fold_entries`' maximum."""
    return fold_entries(y, torch.maximum)


def small_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(a, b)` as a broadcast product summed over the shared dim: (N, M, k) x (N, k, P)
    -> (N, M, P). WHY: Inductor fuses a CPU bmm only when M or P is 1; any other is an extern
    BLAS call per layer, whose fixed cost dwarfs a product of a few rows."""
    return (a[:, :, :, None] * b[:, None, :, :]).sum(2)


def exclusive_cumsum(x: torch.Tensor, small: bool = False) -> torch.Tensor:
    """Sum of the earlier entries along dim 1 (not counting the entry itself), int64:
    (B, C, ...) -> (B, C, ...).

    Args:
        x: bool or integer tensor.
        small: for a few entries: the sum over a strictly-lower-triangular mask, one fused
            reduction under Inductor (its CPU cumsum is an extern call per use).
    """
    x = x.long()
    return _triangular_sum(x, strict=True) if small else x.cumsum(1) - x


def inclusive_cumsum(x: torch.Tensor, small: bool = False) -> torch.Tensor:
    """`x.cumsum(1)` in int64; `small` as in `exclusive_cumsum`. One entry per row (decode) is
    its own sum: no op at all (a cumsum is an extern call under Inductor, a portable kernel in .pte)."""
    x = x.long()
    if x.shape[1] == 1:
        return x
    return _triangular_sum(x, strict=False) if small else x.cumsum(1)


def _triangular_sum(x: torch.Tensor, strict: bool) -> torch.Tensor:
    C = x.shape[1]
    ar = torch.arange(C, device=x.device)
    tri = ar[:, None] > ar[None, :] if strict else ar[:, None] >= ar[None, :]
    tri = tri.view(1, C, C, *([1] * (x.dim() - 2)))  # (1, C, C', ...) c' before (or at) c
    return (x[:, None] * tri).sum(2)
