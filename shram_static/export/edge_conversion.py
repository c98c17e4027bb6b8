"""`to_edge`'s per-operator conversions of a method in one re-trace where the stock call makes
five (a lowering speed-up, see `lowering.lowering_speedups`): the same edge program, each step
saying why it is."""

import contextlib

import torch

from ..accelerators import enabled


def pass_name(p) -> str:
    """A pass object's class name, or the name of torch's `pass_result_wrapper` around one."""
    return getattr(p, "__name__", type(p).__name__)


# ATen-to-edge passes that rewrite one operator call at a time (each only overrides
# `call_operator`, ending in `super().call_operator`), in the order `to_edge` runs them.
_PER_OP_EDGE_PASSES = ("ScalarToTensorPass", "RemoveMixedTypeOperators", "OpReplacePass", "MemoryFormatOpsPass")


def _view_ops_to_copies_in_place(graph_module) -> bool | None:
    """What torch's `ReplaceViewOpsWithViewCopyOpsPass` (torch 2.13-2.14) does to a graph
    without higher-order ops, as a change of targets in place: every ATen view op becomes its
    `_copy` variant (`_unsafe_view`: `view_copy`), same arguments.

    Node values keep the views' strides (shapes and dtypes are the copies'), until
    `one_edge_conversion_trace`'s fused re-trace recomputes them. Before it, only `to_edge`'s
    `RemoveToCopyPass` reads a stride: it drops a same-dtype `_to_copy` whose input and output
    strides agree. With every view a copy, every tensor is dense, so the stock pass drops each
    such `_to_copy` that keeps the input's layout; on the views' values it decides the same
    unless the input is a view that is not dense (a strided slice, an expand: its copy is laid
    out contiguously) or the `_to_copy` asks for a layout (a transposed view's copy already has
    it). A graph with such a `_to_copy`, or with a higher-order op, is left untouched.

    Returns:
        Whether any node changed; None if the graph was left for the stock pass.
    """
    from torch._export.passes.replace_view_ops_with_view_copy_ops_pass import (
        _NON_FUNCTIONAL_OPS_TO_FUNCTIONAL_OPS, get_view_copy_of_view_op)
    from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

    for node in graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            return None  # its subgraphs are the stock pass's to rewrite
        if node.op == "call_function" and node.target is torch.ops.aten._to_copy.default:
            val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if not isinstance(val, torch.Tensor) or not is_non_overlapping_and_dense(val) \
                    or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
                return None
    changed = False
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            copy = (_NON_FUNCTIONAL_OPS_TO_FUNCTIONAL_OPS.get(node.target)
                    or get_view_copy_of_view_op(node.target._schema))
            if copy is not None:
                node.target, changed = copy, True
    if changed:
        graph_module.recompile()
    return changed


@contextlib.contextmanager
def one_edge_conversion_trace():
    """Within the block, `to_edge` runs its four per-operator conversion passes in one re-trace
    of each method instead of four.

    WHY: `ScalarToTensorPass`, `RemoveMixedTypeOperators`, `OpReplacePass` (ATen -> edge ops)
    and `MemoryFormatOpsPass` (`_to_copy` -> `_to_dim_order_copy`) are `ExportPass`es that each
    re-trace every node with fake tensors to rewrite single calls: four full traces per method.
    Each overrides only `call_operator` and hands its
    result to `super().call_operator`, so one class deriving from all four, in `to_edge`'s
    order, applies them to each call in turn (what the cast inserted for a mixed-type add goes
    through next is OpReplace and MemoryFormat, as in the separate passes). Between the first
    and the second, `to_edge` runs three graph-level clean-ups (`RemoveNoopPass`,
    `PruneEmptyTensorsPass`, `RemoveToCopyPass`) that match ATen no-op copies, slices and
    empty cat inputs, none of which a scalar argument turned into a tensor creates or removes,
    so they now run before the fused trace. The view-to-copy pass that `to_edge` runs before
    all of them (torch's `ReplaceViewOpsWithViewCopyOpsPass`, one more full re-trace per method)
    rewrites one call at a time too, an op for its `_copy`
    variant with the same arguments; it becomes that change of each node's target in place
    (`_view_ops_to_copies_in_place`), and the fused trace after it recomputes every value.
    tests/test_lowering.py compares the emitted bytes with ExecuTorch's stock lowering.
    `_generate_edge_program` reads the pass classes and list when it runs, so they are swapped
    for the block only; runs only on the releases it was verified on (shram_static/accelerators.py).
    """
    if not enabled("one_edge_conversion_trace"):  # off: the stock path
        yield
        return
    from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass
    from torch.fx.passes.infra.pass_base import PassBase, PassResult

    from executorch.exir.passes.memory_format_ops_pass import MemoryFormatOpsPass
    from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators
    from executorch.exir.passes.replace_aten_with_edge_pass import OpReplacePass
    from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass
    from executorch.exir.program import _program

    class AlreadyApplied(PassBase):
        def call(self, graph_module):
            return PassResult(graph_module, False)

    class ViewOpsToCopiesInPlace(PassBase):
        def call(self, graph_module):
            changed = _view_ops_to_copies_in_place(graph_module)
            if changed is None:
                return ReplaceViewOpsWithViewCopyOpsPass()(graph_module)
            return PassResult(graph_module, changed)

    generate = _program._generate_edge_program

    def generate_fused(config, *args, **kwargs):
        bases = (ScalarToTensorPass, RemoveMixedTypeOperators, OpReplacePass)
        if not config._skip_dim_order:  # to_edge runs MemoryFormatOpsPass only then
            bases += (MemoryFormatOpsPass,)
        fused = type("FusedEdgeConversionPass", bases, {})
        get = _program._get_aten_to_edge_passes  # (maybe `needed_edge_passes_only`'s)

        def without_fused(cfg):
            pre, post = get(cfg)
            return [p for p in pre if pass_name(p) not in _PER_OP_EDGE_PASSES], post

        saved = (_program._get_aten_to_edge_passes, _program.OpReplacePass, _program.MemoryFormatOpsPass,
                 _program.ReplaceViewOpsWithViewCopyOpsPass)
        _program._get_aten_to_edge_passes = without_fused
        _program.OpReplacePass, _program.MemoryFormatOpsPass = fused, AlreadyApplied
        _program.ReplaceViewOpsWithViewCopyOpsPass = ViewOpsToCopiesInPlace
        try:
            return generate(config, *args, **kwargs)
        finally:
            (_program._get_aten_to_edge_passes, _program.OpReplacePass, _program.MemoryFormatOpsPass,
             _program.ReplaceViewOpsWithViewCopyOpsPass) = saved

    _program._generate_edge_program = generate_fused
    try:
        yield
    finally:
        _program._generate_edge_program = generate
