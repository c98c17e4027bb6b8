"""Entmax-1.2 by a fixed number of Newton steps on the threshold (docs/design.md, "Routing").

docs/design.md ("Routing") defines the scores by bisection: p_i = max(x_i - tau, 0)^5 with x = 0.2 z and tau
the root of f(tau) = sum_i p_i = 1. The solve scales x by L^(1/5), so that the root is where
the mean of c^5 (c = max(x - tau, 0)) is 1, and runs Newton's method on g = mean(c^5)^(1/4)
= 1 rather than on f itself. g is convex and decreasing in tau (a 5-norm of c, convex in tau,
raised to the power 5/4 >= 1), so Newton started left of the root, at tau_0 = max(x) - L^(1/5)
where the max term alone gives g >= 1, moves right monotonically and never overshoots: the
tangent of a convex function lies below it.

WHY g and not f: with one term in the support f is (a - tau)^5, where a Newton step leaves 4/5
of the distance to the root; g is then (a - tau)^(5/4), where a step leaves 1/5. Far from the
root, f took ~log_1.25 L^0.2 steps before converging quadratically (7 at L = 16, 12 at 4096);
g takes 3 up to L = 256 and 4 up to 4096 to reach the fp32 rounding floor (measured against
`entmax.entmax_bisect` on tied, dominant, wide, narrow and geometric logits; `newton_steps`
keeps one more). Each step costs two square roots and a division more (14 elementwise ops
and means instead of 11), so the exported graph has a quarter fewer entmax nodes: export time
and each runtime's per-node work follow the node count.

WHY Newton and not the 50 halvings: a fixed number of steps with no data-dependent loop, like
bisection, so one code path runs eagerly, compiles with fullgraph=True and exports, at a
fraction of the nodes.
"""

import math

import torch

from .reductions import max_last

ALPHA = 1.2


def newton_steps(L: int) -> int:
    """Newton steps that reach fp32 precision for L experts, one more than measured (static: a
    Python int): 4 up to L = 64, 5 up to L = 4096."""
    return 3 + math.ceil(math.log(max(L, 2)) / math.log(64))


def entmax12(z: torch.Tensor) -> torch.Tensor:
    """Entmax with alpha = 1.2 over the last dimension, computed in fp32.

    Args:
        z: logits (..., L), any float dtype.

    Returns:
        Probabilities (..., L) in fp32, summing to 1.
    """
    L = z.shape[-1]
    s = L ** (1 / 5)
    # One (N, 1, 1, L) view for the whole solve: XNNPACK delegates a 4-D mean over the two
    # innermost dims (shram_static.reductions), so each mean is one node, with no reshapes
    # around it. x is scaled by L^(1/5): the root is where mean(c^5) = 1.
    x = (z.float() * ((ALPHA - 1) * s)).reshape(-1, 1, 1, L)  # (N, 1, 1, L)
    tau = max_last(x) - s  # (N, 1, 1, 1), g(tau) >= 1: the max term alone gives mean(c^5) = 1
    for _ in range(newton_steps(L)):
        # c^5 and c^4 as products and the fourth root as two square roots, not pow: XNNPACK
        # delegates mul and sqrt but leaves pow on portable kernels (TOOLCHAIN_NOTES), which
        # would split the delegate.
        c = (x - tau).clamp(min=0.0)
        c2 = c * c
        c4 = c2 * c2
        m5 = (c4 * c).mean(dim=(2, 3), keepdim=True)  # > 0 left of the root: c_max >= 1
        m4 = c4.mean(dim=(2, 3), keepdim=True)
        g = m5.sqrt().sqrt()  # m5^(1/4)
        # tau <- tau - (g - 1) / g'(tau), g' = -(5/4) m4 m5^(-3/4); (g - 1) m5^(3/4) = m5 - m5 / g
        tau = tau + (m5 - m5 / g) / (m4 * 1.25)
    c = (x - tau).clamp(min=0.0)
    c2 = c * c
    p = c2 * c2 * c  # (N, 1, 1, L)
    p = p / (p.mean(dim=(2, 3), keepdim=True) * L)
    return p.reshape(z.shape)
