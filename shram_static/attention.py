"""Masked softmax attention that is safe on rows with no visible key, on every backend."""

import torch


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v, with rows that see nothing giving 0.

    Explicit matmul + masked softmax rather than SDPA: SDPA's fully-masked rows give 0 in
    eager/ExecuTorch but mean(V) in the ONNX export (TOOLCHAIN_NOTES), and neither backend has
    a fused attention kernel to gain.

    Args:
        q: (..., Q, u); k, v: (..., S, u); mask: bool broadcastable to (..., Q, S).
        scale: score scale.

    Returns:
        (..., Q, u).
    """
    s = (q @ k.transpose(-1, -2)) * scale  # (..., Q, S)
    # finfo.min instead of -inf: softmax of an all--inf row is NaN, and NaN * 0 stays NaN.
    s = torch.where(mask, s, torch.finfo(s.dtype).min)
    a = torch.softmax(s, dim=-1) * mask.any(-1, keepdim=True).to(s.dtype)
    return a @ v
