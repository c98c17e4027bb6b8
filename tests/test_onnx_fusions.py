"""`export.onnx_fusions`: the RMSNorm, RoPE and max-tree forms of a step become one opset-23 node
each, with onnxruntime giving the values numpy gives for the unfused formula; forms that only
look alike stay as they are. (The exported steps themselves are checked against the golden
cases in test_export_onnx.py, whose graph contract counts the fused nodes.)"""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from shram_static.export.onnx_fusions import OPSET, fuse_onnx_ops
from shram_static.reductions import max_last, mean_last
from shram_static.rope import apply_rope


class Forms(torch.nn.Module):
    """The library's own RMSNorm, RoPE (both layouts) and max (over 8 and over 6) forms, as a
    step writes them."""

    def __init__(self, d: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x, q, cos_l, sin_l, k, cos_s, sin_s, z8, z6):
        norm = self.scale * (x * torch.rsqrt(mean_last(x * x) + 1e-5))  # (B, C, d)
        return (norm, apply_rope(q, cos_l, sin_l), apply_rope(k, cos_s, sin_s),
                max_last(z8), max_last(z6))


def _export(mod, args) -> ir.Model:
    with torch.no_grad():
        return torch.onnx.export(mod, args, dynamo=True, optimize=True, verbose=False,
                                 opset_version=OPSET).model


def _run(model: ir.Model, args) -> list[np.ndarray]:
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_forms_fuse_and_keep_their_values():
    torch.manual_seed(0)
    B, A, S, u, d = 2, 3, 5, 8, 12

    def rows(*lead):  # cos, sin rows (..., u), both halves the same angles
        ang = torch.rand(*lead, u // 2) * 6
        return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    # q (B, H, S, u) with rows per position (local path: (B, 1, S, u)); k (B, C, K, u) with rows
    # per (row, token) (sparse path: (B, C, 1, u))
    args = (torch.randn(B, S, d), torch.randn(B, A, S, u), *rows(B, 1, S), torch.randn(B, A, S, u),
            *rows(B, A, 1), torch.randn(B, S, 8), torch.randn(B, S, 6))
    mod = Forms(d).eval()
    model = _export(mod, args)
    counts = fuse_onnx_ops(model)
    # max over 8: a tree of halves, one ReduceMax; over 6: 6 -> 3 -> (halves of 2, cat with the
    # odd one) -> 2 -> 1, where only the last level (halves of a width-2 tensor) fuses
    assert counts == {"RMSNormalization": 1, "RotaryEmbedding": 2, "ReduceMax": 2}, counts
    ops = _ops(model)
    assert not {"Neg", "Sqrt", "Reciprocal"} & set(ops) and ops.count("Max") == 2, ops
    with torch.no_grad():
        want = [t.numpy() for t in mod(*args)]
    for got, ref in zip(_run(model, args), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_look_alikes_stay():
    """A mean over two rows at once, RoPE rows that differ per head and position, and a max of
    two slices that are not halves: each keeps its plain nodes, and the values hold."""

    class LookAlikes(torch.nn.Module):
        def forward(self, x, q, cos, sin, z):
            B, S, d = x.shape
            ms = (x * x).reshape(B, 1, S, d).mean(dim=(2, 3), keepdim=True).reshape(B, 1, 1)  # (B, 1, 1)
            norm = 2.0 * (x * torch.rsqrt(ms + 1e-5))
            return norm, apply_rope(q, cos, sin), torch.maximum(z[..., :1], z[..., 2:3])

    torch.manual_seed(1)
    B, A, S, u, d = 2, 3, 5, 8, 12
    ang = torch.rand(B, A, S, u // 2)
    args = (torch.randn(B, S, d), torch.randn(B, A, S, u), torch.cat([ang.cos()] * 2, -1),
            torch.cat([ang.sin()] * 2, -1), torch.randn(B, S, 4))
    model = _export(LookAlikes().eval(), args)
    before = sorted(_ops(model))
    assert fuse_onnx_ops(model) == {"RMSNormalization": 0, "RotaryEmbedding": 0, "ReduceMax": 0}
    assert sorted(_ops(model)) == before
    want = [t.numpy() for t in LookAlikes()(*args)]
    for got, ref in zip(_run(model, args), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_needs_opset_23():
    g = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                               [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = ir.from_proto(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)]))
    with pytest.raises(ValueError, match="opset-23 model, got opset 18"):
        fuse_onnx_ops(model)
    assert [n.op_type for n in model.graph] == ["Relu"]
