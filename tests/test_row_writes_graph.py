"""`export.web.row_writes_graph` on small hand-made graphs: the outputs it lays the written rows
out in, what it refuses. (The site's own row-writes graphs: tests/test_web.py.)"""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _state_graph(path, rows_dims=(2, 2)):
    """A pure step over three states: a, b (float [4, 2]) written at `i` with relu(x), and
    c (int64 [5, 3]) written at `j` with y."""
    ins = [helper.make_tensor_value_info("past.a", F, [4, 2]), helper.make_tensor_value_info("past.b", F, [4, 2]),
           helper.make_tensor_value_info("past.c", I64, [5, 3]), helper.make_tensor_value_info("x", F, list(rows_dims)),
           helper.make_tensor_value_info("i", I64, [rows_dims[0], 1]), helper.make_tensor_value_info("y", I64, [1, 3]),
           helper.make_tensor_value_info("j", I64, [1, 1])]
    outs = [helper.make_tensor_value_info("logits", F, list(rows_dims)),
            *(helper.make_tensor_value_info(f"present.{n}", t, s) for n, t, s in
              (("a", F, [4, 2]), ("b", F, [4, 2]), ("c", I64, [5, 3])))]
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["logits"]),
             helper.make_node("ScatterND", ["past.a", "i", "r"], ["present.a"]),
             helper.make_node("ScatterND", ["past.b", "i", "r"], ["present.b"]),
             helper.make_node("ScatterND", ["past.c", "j", "y"], ["present.c"])]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", ins, outs), opset_imports=[helper.make_opsetid("", 18)]),
              str(path))


def _apply(state, got, layout):
    """The oracle of how a runtime applies the outputs: each state's n rows, in order."""
    new = {k: v.copy() for k, v in state.items()}
    for w in layout:
        for k in range(w["n"]):
            new[w["state"]][got["write.index"][w["at"] + k, 0]] = got[w["rows"]][w["from"] + k]
    return new


def test_row_writes_graph_lays_every_states_rows_out_in_few_outputs(tmp_path):
    """The written rows come back as one index output and one rows output per kind of row, laid
    out by the `shram_writes` metadata; applied by it, they give the plain graph's next state
    (onnxruntime runs both). No Identity, one Concat per output."""
    import onnxruntime as ort

    from shram_static.export.web import row_writes_graph
    _state_graph(tmp_path / "m.onnx")
    layout = row_writes_graph(str(tmp_path / "m.onnx"), str(tmp_path / "m.rows.onnx"))
    m = onnx.load(str(tmp_path / "m.rows.onnx"))
    assert json.loads({p.key: p.value for p in m.metadata_props}["shram_writes"]) == layout
    f32, i64 = "write.rows.float32.2", "write.rows.int64.3"
    assert layout == [{"state": "a", "at": 0, "n": 2, "rows": f32, "from": 0},
                      {"state": "b", "at": 2, "n": 2, "rows": f32, "from": 2},
                      {"state": "c", "at": 4, "n": 1, "rows": i64, "from": 0}]
    assert [o.name for o in m.graph.output] == ["logits", "write.index", f32, i64]
    assert sorted(n.op_type for n in m.graph.node) == ["Concat"] * 3 + ["Neg", "Relu"]
    rng = np.random.default_rng(0)
    state = {"a": rng.standard_normal((4, 2)).astype(np.float32), "b": rng.standard_normal((4, 2)).astype(np.float32),
             "c": rng.integers(-9, 9, (5, 3))}
    feeds = {**{f"past.{k}": v for k, v in state.items()}, "x": np.array([[-1.0, 2.0], [3.0, -4.0]], np.float32),
             "i": np.array([[3], [0]]), "y": np.array([[7, 8, 9]]), "j": np.array([[4]])}
    plain = ort.InferenceSession(str(tmp_path / "m.onnx"))
    want = dict(zip([o.name for o in plain.get_outputs()], plain.run(None, feeds)))
    rows = ort.InferenceSession(str(tmp_path / "m.rows.onnx"))
    got = dict(zip([o.name for o in rows.get_outputs()], rows.run(None, feeds)))
    np.testing.assert_array_equal(got["logits"], want["logits"])
    for k, v in _apply(state, got, layout).items():
        np.testing.assert_array_equal(v, want[f"present.{k}"], err_msg=k)


def test_row_writes_graph_refuses_rows_without_a_static_shape(tmp_path):
    from shram_static.export.web import row_writes_graph
    _state_graph(tmp_path / "m.onnx", rows_dims=("n", 2))
    with pytest.raises(ValueError, match=r"rows written to present.a have no static shape \(\[None, 2\]\)"):
        row_writes_graph(str(tmp_path / "m.onnx"), str(tmp_path / "m.rows.onnx"))
    assert not (tmp_path / "m.rows.onnx").exists()


def test_row_writes_graph_refuses_a_state_output_it_cannot_split(tmp_path):
    from shram_static.export.web import row_writes_graph
    x = helper.make_tensor_value_info("past.s", F, [2, 3])
    y = helper.make_tensor_value_info("present.s", F, [2, 3])
    g = helper.make_graph([helper.make_node("Relu", ["past.s"], ["present.s"])], "g", [x], [y])
    onnx.save(helper.make_model(g), str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match="present.s is not a ScatterND of past.s"):
        row_writes_graph(str(tmp_path / "m.onnx"), str(tmp_path / "m.rows.onnx"))
    assert not (tmp_path / "m.rows.onnx").exists()
