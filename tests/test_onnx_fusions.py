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
    """The library's own RMSNorm, RoPE and max forms, as a step writes them."""

    def __init__(self, d: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x, q, cos, sin, z):
        norm = self.scale * (x * torch.rsqrt(mean_last(x * x) + 1e-5))  # (B, C, d)
        return norm, apply_rope(q, cos, sin), max_last(z)


def _export(mod, args) -> ir.Model:
    with torch.no_grad():
        return torch.onnx.export(mod, args, dynamo=True, optimize=True, verbose=False,
                                 opset_version=OPSET).model


def _run(model: ir.Model, args) -> list[np.ndarray]:
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


@pytest.mark.parametrize("rows, L", [("per_position", 8), ("per_expert", 6)])
def test_forms_fuse_and_keep_their_values(rows, L):
    torch.manual_seed(0)
    B, A, S, u, d = 2, 3, 5, 8, 12
    x = torch.randn(B, S, d)
    if rows == "per_position":  # local path: q (B, H, S, u), rows (B, 1, S, u)
        q, shape = torch.randn(B, A, S, u), (B, 1, S, u)
    else:  # sparse path: q (B, C, K, u), rows (B, C, 1, u)
        q, shape = torch.randn(B, A, S, u), (B, A, 1, u)
    ang = torch.rand(*shape[:-1], u // 2) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    z = torch.randn(B, S, L)
    args = (x, q, cos, sin, z)
    mod = Forms(d).eval()
    model = _export(mod, args)
    counts = fuse_onnx_ops(model)
    assert counts["RMSNormalization"] == 1 and counts["RotaryEmbedding"] == 1, counts
    ops = _ops(model)
    assert not {"Neg", "Sqrt", "Reciprocal"} & set(ops), ops
    if L == 8:  # a tree of halves over 2**3: one ReduceMax
        assert counts["ReduceMax"] == 1 and not {"Max", "Concat"} & set(ops), ops
    else:  # 6 -> 3 -> (halves of 2, then cat with the odd one): only the width-2 level fuses
        assert "Max" in ops and "Concat" in ops
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
