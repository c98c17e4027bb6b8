"""Expert weights of the sparse path: both layouts against a loop over tokens and experts, and
the export copy's fused layout never reaching the caller's model."""

import pytest
import torch

from helpers import random_model
from shram_static.fast_layers import FusedExperts, fuse_experts_
from shram_static.export.pte import export_copy
from shram_static.layers import BEA


def loop_all_reference(bea, h, yl, w):
    """Plain float64 loops over every expert: q/k/v (B, L, N, u) of each token, and
    sum_l w_l y_l o_proj[l] (B, N, d) (the uncached forward's dense sparse path)."""
    B, N, _ = h.shape
    L, u = bea.q_proj.shape[0], bea.q_proj.shape[-1]
    q, k, v = (torch.zeros(B, L, N, u, dtype=torch.float64) for _ in range(3))
    out = torch.zeros(B, N, bea.o_proj.shape[-1], dtype=torch.float64)
    for b in range(B):
        for n in range(N):
            x = h[b, n].double()
            for e in range(L):
                q[b, e, n] = x @ bea.q_proj[e].double()
                k[b, e, n] = x @ bea.k_proj[e].double()
                v[b, e, n] = x @ bea.v_proj[e].double()
                out[b, n] += w[b, n, e].double() * (yl[b, e, n].double() @ bea.o_proj[e].double())
    return (q, k, v), out


def loop_reference(bea, h, idx, y, P):
    """Plain float64 loops: q/k/v of each (token, selected expert), and sum_k P_k y_k o_proj."""
    B, C, K = idx.shape
    q, k, v = (torch.zeros(B, C, K, bea.q_proj.shape[-1], dtype=torch.float64) for _ in range(3))
    out = torch.zeros(B, C, bea.o_proj.shape[-1], dtype=torch.float64)
    for b in range(B):
        for c in range(C):
            x = h[b, c].double()
            for j in range(K):
                e = int(idx[b, c, j])
                q[b, c, j] = x @ bea.q_proj[e].double()
                k[b, c, j] = x @ bea.k_proj[e].double()
                v[b, c, j] = x @ bea.v_proj[e].double()
                out[b, c] += P[b, c, j].double() * (y[b, c, j].double() @ bea.o_proj[e].double())
    return (q, k, v), out


@pytest.mark.parametrize("B,C", [(1, 1), (4, 1), (2, 5)])
@torch.no_grad()
def test_both_layouts_match_the_loop(B, C):
    model = random_model(8, num_mosrah_heads=8, num_selected_heads=2)
    bea = model.model.layers[0].attention.sparse_attention.bea
    cfg = model.config
    gen = torch.Generator().manual_seed(B * 10 + C)
    L, K, u, d = cfg.num_mosrah_heads, cfg.num_selected_heads, cfg.head_dim, cfg.embedding_width
    h = torch.randn(B, C, d, generator=gen)
    idx = torch.stack([torch.randperm(L, generator=gen)[:K] for _ in range(B * C)]).view(B, C, K)
    y = torch.randn(B, C, K, u, generator=gen)
    P = torch.rand(B, C, K, generator=gen)
    want_qkv, want_out = loop_reference(bea, h, idx, y, P)
    yl = torch.randn(B, L, C, u, generator=gen)
    w = torch.rand(B, C, L, generator=gen)
    want_all, want_all_out = loop_all_reference(bea, h, yl, w)
    for layout in (bea, FusedExperts(bea)):
        for got, want in zip(layout.project(h, layout.select(idx)), want_qkv):
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layout.output(y, P, layout.select(idx)).double(), want_out, atol=1e-5, rtol=1e-5)
        for got, want in zip(layout.project_all(h), want_all):
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layout.output_all(yl, w).double(), want_all_out, atol=1e-5, rtol=1e-5)


def test_export_copy_fuses_its_own_copy_only():
    model = random_model(9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = export_copy(model)
    assert all(isinstance(m.attention.sparse_attention.bea, FusedExperts) for m in copy.model.layers)
    assert all(type(m.attention.sparse_attention.bea) is BEA for m in model.model.layers)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # the copy holds each expert weight once: the fused linears replace the BEA's tensors
    assert not any(n.endswith(("bea.q_proj", "bea.k_proj", "bea.v_proj", "bea.o_proj")) for n, _ in copy.named_parameters())
    assert fuse_experts_(copy) is copy  # idempotent: already fused layers are left alone


def test_fused_layout_keeps_the_dtype():
    """A bf16 model's fused experts stay bf16 (a float32 default would upcast the sparse path)."""
    bea = random_model(10).model.layers[0].attention.sparse_attention.bea.to(torch.bfloat16)
    fused = FusedExperts(bea)
    assert {t.dtype for t in fused.parameters()} == {torch.bfloat16}
    h = torch.randn(1, 2, bea.q_proj.shape[1], dtype=torch.bfloat16)
    idx = torch.tensor([[[0, 1], [2, 3]]])
    assert all(t.dtype == torch.bfloat16 for t in fused.project(h, fused.select(idx)))
