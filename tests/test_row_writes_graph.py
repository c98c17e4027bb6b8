"""`export.web.row_writes_graph` on small hand-made graphs: which values it renames, where it keeps
an Identity, what it refuses. (The site's own row-writes graphs: tests/test_web.py.)"""

import onnx
import pytest


def test_row_writes_graph_names_the_written_values_as_outputs(tmp_path):
    """A written value a node makes becomes the output under its new name; one that is a graph
    input, or that an earlier output already took, is returned through an Identity. The graph
    still runs and returns what it wrote."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from shram_static.export.web import row_writes_graph
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    ins = [helper.make_tensor_value_info("past.a", f, [4, 2]), helper.make_tensor_value_info("past.b", f, [4, 2]),
           helper.make_tensor_value_info("x", f, [1, 2]), helper.make_tensor_value_info("i", i64, [1, 1])]
    outs = [helper.make_tensor_value_info(n, f, [4, 2]) for n in ("present.a", "present.b")]
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("ScatterND", ["past.a", "i", "r"], ["present.a"]),
             helper.make_node("ScatterND", ["past.b", "i", "r"], ["present.b"])]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", ins, outs), opset_imports=[helper.make_opsetid("", 18)]),
              str(tmp_path / "m.onnx"))
    g = onnx.load(row_writes_graph(str(tmp_path / "m.onnx"), str(tmp_path / "m.rows.onnx"))).graph
    assert [n.output[0] for n in g.node if n.op_type == "Relu"] == ["write.a.rows"]
    assert sorted((n.input[0], n.output[0]) for n in g.node if n.op_type == "Identity") == [
        ("i", "write.a.index"), ("i", "write.b.index"), ("write.a.rows", "write.b.rows")]
    x = np.array([[-1.0, 2.0]], np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.rows.onnx")).run(
        None, {"past.a": np.zeros((4, 2), np.float32), "past.b": np.ones((4, 2), np.float32), "x": x,
               "i": np.array([[3]])})
    np.testing.assert_array_equal(got[1], [[0.0, 2.0]])
    np.testing.assert_array_equal(got[3], [[0.0, 2.0]])
    assert got[0].tolist() == got[2].tolist() == [[3]]


def test_row_writes_graph_refuses_a_state_output_it_cannot_split(tmp_path):
    from onnx import TensorProto, helper

    from shram_static.export.web import row_writes_graph
    x = helper.make_tensor_value_info("past.s", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("present.s", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph([helper.make_node("Relu", ["past.s"], ["present.s"])], "g", [x], [y])
    onnx.save(helper.make_model(g), str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match="present.s is not a ScatterND of past.s"):
        row_writes_graph(str(tmp_path / "m.onnx"), str(tmp_path / "m.rows.onnx"))
    assert not (tmp_path / "m.rows.onnx").exists()
