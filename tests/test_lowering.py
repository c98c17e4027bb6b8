"""The lowering speed-ups (`shram_static.export.lowering`): each applies inside its block only,
and the XNNPACK pass filter drops a pass only when the partition holds nothing it rewrites.

That the lowered programs stay right is checked by running them (tests/test_export_pte.py:
golden logits and tokens through every `.pte`).
"""

import contextlib
import copy
import types

import torch


def _graph(*calls) -> torch.fx.GraphModule:
    """A graph of edge-op calls on one placeholder: (op, extra args) per call, never run."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = x
    for op, args in calls:
        y = g.call_function(op, (y,) + args if args is not None else ([x] * 6, 0))
    g.output(y)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _default_passes():
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    return XNNPACKPassManager(None).passes


def test_pass_filter_keeps_what_can_apply():
    from executorch.exir.dialects._ops import ops as exir_ops

    from shram_static.export.lowering import needed_xnnpack_passes

    default = _default_passes()
    names = [p.__name__ for p in default]
    plain = [p.__name__ for p in needed_xnnpack_passes(_graph((exir_ops.edge.aten.relu.default, ())), default)]
    # Passes without a trigger always run, in XNNPACK's order.
    for always in ("ConvertToLinearPass", "ConstPropPass", "FuseActivationPass",
                   "ChannelsLastTaggedReshapePass", "RemoveRedundantCopyPass"):
        assert always in plain
    assert plain == [n for n in names if n in plain]
    for skipped in ("ConvertToUpsampleBilinear2d", "ConvertToSDPAPass", "DecomposeBatchNorm",
                    "FuseBatchNormPass", "Conv1dUnsqueezePass", "PReLUReshapePass", "RemoveGetItemPass",
                    "DecomposeConcatenate", "PropagateCustomMetaPass", "DimOrderOpsRevertPass"):
        assert skipped not in plain
    # A node a pass acts on brings it back.
    conv = _graph((exir_ops.edge.aten.convolution.default, (None, None, [1], [0], [1], False, [0], 1)))
    assert "Conv1dUnsqueezePass" in [p.__name__ for p in needed_xnnpack_passes(conv, default)]
    cat6 = _graph((exir_ops.edge.aten.cat.default, None))
    assert "DecomposeConcatenate" in [p.__name__ for p in needed_xnnpack_passes(cat6, default)]
    dq = _graph((exir_ops.edge.quantized_decomposed.dequantize_per_tensor.default, (0.1, 0, -128, 127, torch.int8)))
    assert "PropagateCustomMetaPass" in [p.__name__ for p in needed_xnnpack_passes(dq, default)]


def test_pass_filter_is_scoped():
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.dialects._ops import ops as exir_ops

    from shram_static.export.lowering import needed_xnnpack_passes_only

    default = _default_passes()
    ep = types.SimpleNamespace(graph_module=_graph((exir_ops.edge.aten.relu.default, ())))
    with needed_xnnpack_passes_only():
        assert len(XNNPACKPassManager(ep).passes) < len(default)
        assert XNNPACKPassManager(ep, passes=default[:1]).passes == default[:1]  # explicit lists kept
    assert XNNPACKPassManager(ep).passes == default


def test_shared_provenance_is_scoped():
    """NodeSource deep copies are shared inside the block only."""
    from torch.fx.traceback import NodeSource

    from shram_static.export.lowering import shared_provenance

    ns = NodeSource(None, "p")
    with shared_provenance():
        assert copy.deepcopy([ns])[0] is ns
    assert copy.deepcopy(ns) is not ns and "__deepcopy__" not in NodeSource.__dict__


def test_onnx_rule_skip_keeps_the_optimized_graph():
    """Without the skipped rewrite rules the exporter's optimizer makes the same graph (op for
    op) from a SHRAM step, here the tiny model's chunk step; the rules come back after."""
    import collections

    import onnx_ir as ir
    import onnxscript.optimizer
    from onnxscript import rewriter

    from helpers import tiny_model
    from shram_static.export.lowering import SKIPPED_ONNX_RULES, without_onnx_rewrite_rules
    from shram_static.export.pte import export_copy
    from shram_static.state import StaticState
    from shram_static.step import FunctionalStep

    rules = rewriter._DEFAULT_REWRITE_RULES
    assert {r.name for r in rules} >= set(SKIPPED_ONNX_RULES)  # the names still exist
    model = export_copy(tiny_model())
    state = StaticState(model.config, 2, 4)
    args = (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long),
            torch.ones(2, 4, dtype=torch.bool), *[t.clone() for t in state.tensors()])
    with torch.no_grad():
        raw = ir.to_proto(torch.onnx.export(FunctionalStep(model, state).eval(), args, dynamo=True,
                                            optimize=False, verbose=False).model)

    def optimized_ops(skip: bool) -> collections.Counter:
        m = ir.from_proto(raw)
        with without_onnx_rewrite_rules() if skip else contextlib.nullcontext():
            if skip:
                assert not {r.name for r in rewriter._DEFAULT_REWRITE_RULES} & set(SKIPPED_ONNX_RULES)
            onnxscript.optimizer.optimize_ir(m)
        return collections.Counter(n.op_type for n in m.graph.all_nodes())

    full, skipped = optimized_ops(False), optimized_ops(True)
    assert skipped == full and sum(full.values()) < 2000, (skipped - full, full - skipped)
    assert rewriter._DEFAULT_REWRITE_RULES is rules


def test_written_cache_views_rebased_on_the_buffer():
    """A reshape of a cache's last in-place write is re-based on the written buffer (so it can
    be a free view); a reshape of an earlier write, which a later write changes, is left alone."""
    from executorch.exir.dialects._ops import ops as exir_ops

    from shram_static.export.views import written_cache_views_pass

    ip, view = exir_ops.edge.aten.index_put_.default, exir_ops.edge.aten.view_copy.default
    g = torch.fx.Graph()
    buf, idx, val = g.placeholder("buf"), g.placeholder("idx"), g.placeholder("val")
    w1 = g.call_function(ip, (buf, [idx], val))
    v1 = g.call_function(view, (w1, [4, 2]))  # read before the second write
    w2 = g.call_function(ip, (w1, [idx], val))
    v2 = g.call_function(view, (w2, [2, 4]))
    g.output((v1, v2))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    res = written_cache_views_pass(gm)
    assert res.modified
    assert v2.args[0] is buf and v2.args[1] == [2, 4]
    assert v1.args[0] is w1  # an earlier write: untouched
    assert not written_cache_views_pass(_graph((view, ([8],)))).modified  # no write: nothing
