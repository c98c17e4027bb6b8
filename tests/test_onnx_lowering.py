"""The ONNX export's speed-up (the skipped rewrite rules of `shram_static.export.onnx`): it gives the stock exporter's graph, node for
node, on a SHRAM step. That the `.onnx` files compute the right logits is checked by running them
(tests/test_export_onnx.py).
"""

import contextlib

import pytest
import torch

from helpers import counting_traces, needs


@pytest.fixture(scope="module")
def onnx_step():
    """(step, example inputs, its unoptimized ONNX graph as `torch.onnx.export` makes it from
    the module, the traces that took): the tiny model's chunk step cut to one layer (every
    layer is the same graph)."""
    import onnx_ir as ir

    from helpers import tiny_model
    from shram_static.export.onnx_fusions import OPSET
    from shram_static.export.pte import export_copy
    from shram_static.state import StaticState
    from shram_static.step import FunctionalStep

    model = export_copy(tiny_model(num_decoder_layers=1))
    state = StaticState(model.config, 2, 4)
    fn = FunctionalStep(model, state).eval()
    args = (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long),
            torch.ones(2, 4, dtype=torch.bool), *[t.clone() for t in state.tensors()])
    with counting_traces() as traces, torch.no_grad():
        raw = ir.to_proto(torch.onnx.export(fn, args, dynamo=True, optimize=False, verbose=False,
                                            opset_version=OPSET).model)
    return fn, args, raw, traces




@pytest.mark.heavy
@needs('skip_onnx_slices_split')
def test_onnx_rule_skip_keeps_the_optimized_graph(onnx_step):
    """Without the skipped rewrite rules the exporter's optimizer makes the same graph (op for
    op) from a SHRAM step; the rules come back after."""
    import collections

    import onnx_ir as ir
    import onnxscript.optimizer
    from onnxscript import rewriter

    from shram_static.accelerators.onnx_rules import SKIPPED_ONNX_RULES, without_onnx_rewrite_rules

    rules = rewriter._DEFAULT_REWRITE_RULES
    assert {r.name for r in rules} >= set(SKIPPED_ONNX_RULES)  # the names still exist
    raw = onnx_step[2]

    def optimized_ops(skip: bool) -> collections.Counter:
        m = ir.from_proto(raw)
        with without_onnx_rewrite_rules() if skip else contextlib.nullcontext():
            if skip:
                assert not {r.name for r in rewriter._DEFAULT_REWRITE_RULES} & set(SKIPPED_ONNX_RULES)
            onnxscript.optimizer.optimize_ir(m)
        return collections.Counter(n.op_type for n in m.graph.all_nodes())

    full, skipped = optimized_ops(False), optimized_ops(True)
    assert skipped == full and sum(full.values()) < 1000, (skipped - full, full - skipped)
    assert rewriter._DEFAULT_REWRITE_RULES is rules


