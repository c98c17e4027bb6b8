"""Entmax-1.2 by a fixed number of Newton steps on the threshold (docs/design.md, "Routing").

With x = 0.2 z scaled by L^(1/5), the root tau is where mean(c^5) = 1, c = max(x - tau, 0).
Newton runs on g = mean(c^5)^(1/4), convex and decreasing in tau, from tau_0 = max(x) - L^(1/5)
(left of the root), so it moves right monotonically and never overshoots. WHY g, not mean(c^5):
with one term in the support a step on g leaves 1/5 of the distance to the root, not 4/5. WHY
Newton, not bisection's 50 halvings: a few fixed steps, no data-dependent loop, far fewer nodes.
"""
import math

import torch

from .reductions import max_last, max_unrolled, mean_unrolled

ALPHA = 1.2


def newton_steps(L: int) -> int:
    """Newton steps that reach fp32 precision for L experts, one more than needed (a Python int)."""
    return 3 + math.ceil(math.log(max(L, 2)) / math.log(64))


def mean_4d(t: torch.Tensor) -> torch.Tensor:
    """Mean of (N, 1, 1, L) over its two innermost dims, kept: the form XNNPACK delegates."""
    return t.mean(dim=(2, 3), keepdim=True)


def entmax12(z: torch.Tensor, mean=mean_4d, amax=max_last) -> torch.Tensor:
    """Entmax with alpha = 1.2 over the last dimension, computed in fp32.

    Args:
        z: logits (..., L), any float dtype.
        mean, amax: (N, 1, 1, L) -> (N, 1, 1, 1), the solve's means and its start's max
            (`mean_4d`, `reductions.max_last`; in a step compiled by Inductor their unrolled
            forms: `entmax12_unrolled`).

    Returns:
        Probabilities (..., L) in fp32, summing to 1.
    """
    L = z.shape[-1]
    s = L ** (1 / 5)
    # one (N, 1, 1, L) view for the whole solve: XNNPACK delegates a 4-D mean over the two
    # innermost dims (`reductions`), one node with no reshapes around it
    x = (z.float() * ((ALPHA - 1) * s)).reshape(-1, 1, 1, L)  # (N, 1, 1, L)
    tau = amax(x) - s  # (N, 1, 1, 1), g(tau) >= 1: the max term alone gives mean(c^5) = 1
    for _ in range(newton_steps(L)):
        # products and square roots, not pow: XNNPACK leaves pow on portable kernels
        c = (x - tau).clamp(min=0.0)
        c2 = c * c
        c4 = c2 * c2
        m5 = mean(c4 * c)  # > 0 left of the root: c_max >= 1
        m4 = mean(c4)
        g = m5.sqrt().sqrt()  # m5^(1/4)
        # tau <- tau - (g - 1) / g'(tau), g' = -(5/4) m4 m5^(-3/4); (g - 1) m5^(3/4) = m5 - m5 / g
        tau = tau + (m5 - m5 / g) / (m4 * 1.25)
    c = (x - tau).clamp(min=0.0)
    c2 = c * c
    p = c2 * c2 * c  # (N, 1, 1, L)
    p = p / (mean(p) * L)
    return p.reshape(z.shape)


def entmax12_unrolled(z: torch.Tensor) -> torch.Tensor:
    """`entmax12` with its means and max over single entries (`reductions.mean_unrolled`,
    `max_unrolled`), for the steps Inductor compiles (`fast_layers.FusedRouter`): the whole solve
    fuses into the layer's loops."""
    return entmax12(z, mean_unrolled, max_unrolled)
