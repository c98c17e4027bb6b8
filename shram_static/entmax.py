"""Entmax-1.2 by fixed-iteration bisection (SPEC A.6).

A fixed number of steps and no data-dependent loop, so the same code runs eagerly, compiles
with fullgraph=True and exports to ExecuTorch and ONNX. The SPEC's 50 halvings are done as
10 rounds of a 32-way search (32^10 = 2^50): each round evaluates the 32 grid points of the
current bracket at once and keeps the last one whose mass is still >= 1, which is the point
5 halvings would reach. Same grid, same answer, 5x fewer sequential steps: 50 sequential
halvings made Inductor spend ~40 s compiling one entmax and gave ExecuTorch/ONNX graphs
of hundreds of ops per layer. Matches `entmax.entmax_bisect(z, alpha=1.2)` (tested).
"""

import torch

from .reductions import max_last, sum_last

ALPHA = 1.2
HALVINGS = 50
WAYS = 32  # 2^5 grid points per round


def _p(x: torch.Tensor) -> torch.Tensor:
    # max(x, 0)^(1/(alpha-1)) = c^5; written as products instead of pow because XNNPACK
    # delegates mul but leaves pow on portable kernels (TOOLCHAIN_NOTES), splitting the graph.
    c = x.clamp(min=0.0)
    c2 = c * c
    return c2 * c2 * c


def entmax12(z: torch.Tensor) -> torch.Tensor:
    """Entmax with alpha = 1.2 over the last dimension, computed in fp32.

    Args:
        z: logits (..., L), any float dtype.

    Returns:
        Probabilities (..., L) in fp32, summing to 1.
    """
    L = z.shape[-1]
    x = (z.float() * (ALPHA - 1))[..., None, :]  # (..., 1, L)
    mx = max_last(x)  # (..., 1, 1)
    tau_lo = mx - 1.0  # sum p(tau_lo) >= 1
    dm = (mx - (1.0 / L) ** (ALPHA - 1)) - tau_lo  # bracket width
    k = torch.arange(1, WAYS + 1, device=z.device, dtype=torch.float32)[:, None]  # (M, 1)
    for _ in range(HALVINGS // 5):
        dm = dm / WAYS
        tau = tau_lo + dm * k  # (..., M, 1) grid of the bracket
        f = sum_last(_p(x - tau))  # (..., M, 1) mass at each grid point
        # The mass decreases with tau: the accepted points form a prefix; count them. The
        # step function f >= 1 as clamp((f - 1) * 1e30 + 1, 0, 1) (exact in fp32: |f - 1| is
        # 0 or >= 2^-24) and the count as a mean, because XNNPACK delegates clamp, mul and a
        # 4-D mean, but not ge, a bool->float cast or sum (each would split the delegate).
        ok = ((f - 1.0) * 1e30 + 1.0).clamp(0.0, 1.0)  # (..., M, 1)
        tau_lo = tau_lo + dm * sum_last(ok.transpose(-1, -2))
    p = _p(x - tau_lo)[..., 0, :]  # (..., L)
    return p / sum_last(p)
