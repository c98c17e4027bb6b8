"""Entmax-1.2 by fixed-iteration bisection (SPEC A.6).

A fixed number of halvings and no data-dependent loop, so the same code runs eagerly,
compiles with fullgraph=True and exports to ExecuTorch and ONNX. Matches
`entmax.entmax_bisect(z, alpha=1.2)` (tested against it).
"""

import torch

ALPHA = 1.2
N_ITER = 50


def _p(x: torch.Tensor) -> torch.Tensor:
    # max(x, 0)^(1/(alpha-1)) = c^5; written as products instead of pow because XNNPACK
    # delegates mul but leaves pow on portable kernels (TOOLCHAIN_NOTES), splitting the graph.
    c = x.clamp(min=0.0)
    c2 = c * c
    return c2 * c2 * c


def entmax12(z: torch.Tensor, n_iter: int = N_ITER) -> torch.Tensor:
    """Entmax with alpha = 1.2 over the last dimension, computed in fp32.

    Args:
        z: logits (..., L), any float dtype.
        n_iter: bisection halvings.

    Returns:
        Probabilities (..., L) in fp32, summing to 1.
    """
    L = z.shape[-1]
    x = z.float() * (ALPHA - 1)  # (..., L)
    mx = x.amax(dim=-1, keepdim=True)  # (..., 1)
    tau_lo = mx - 1.0
    tau_hi = mx - (1.0 / L) ** (ALPHA - 1)
    dm = tau_hi - tau_lo
    p = _p(x - tau_lo)
    for _ in range(n_iter):
        dm = dm * 0.5
        tau_m = tau_lo + dm
        p = _p(x - tau_m)
        f = p.sum(dim=-1, keepdim=True) - 1.0
        # Branchless "tau_lo = tau_m where f >= 0".
        tau_lo = torch.where(f >= 0, tau_m, tau_lo)
    return p / p.sum(dim=-1, keepdim=True)
