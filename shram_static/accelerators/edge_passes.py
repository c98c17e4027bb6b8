"""ExecuTorch's lowering of a SHRAM step less the work whose result is thrown away: XNNPACK's
`preprocess` and ExecuTorch's edge passes skip the passes that cannot change the graph, and
`to_edge`'s per-operator conversions run in one re-trace. The program is the stock lowering's
(tests/test_accelerators.py compares the bytes); each runs only where its accelerator is on.
"""

import contextlib

import torch

from .registry import enabled, patched


def pass_name(p) -> str:
    """A pass object's class name, or the name of torch's `pass_result_wrapper` around one."""
    return getattr(p, "__name__", type(p).__name__)


# ATen-to-edge passes that rewrite one operator call at a time (each only overrides
# `call_operator`, ending in `super().call_operator`), in the order `to_edge` runs them.
_PER_OP_EDGE_PASSES = ("ScalarToTensorPass", "RemoveMixedTypeOperators", "OpReplacePass",
                       "MemoryFormatOpsPass")


def _op_name(node) -> str:
    """'aten.cat.default' for an edge or aten op node, '' for anything else."""
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def _pass_triggers() -> dict:
    """Pass name -> predicate on a node: the pass (XNNPACK's, ExecuTorch's edge passes) can change the
    graph only if some node satisfies it (read off each pass's source in the verified releases)."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant
    from executorch.exir.passes.dim_order_ops_registry import MemoryFormatOpsMap
    from executorch.exir.passes.legalize_portable_dim_order_pass import LegalizePortableDimOrderPass

    def named(*names):
        return lambda n: _op_name(n) in names

    def symbolic(n) -> bool:
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        return any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
                   or (isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape))
                   for v in vals)

    def non_default_dim_order_input(n) -> bool:
        if n.op != "call_function" or n.target not in LegalizePortableDimOrderPass._target_ops:
            return False
        v = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        return isinstance(v, torch.Tensor) and tuple(v.dim_order()) != tuple(range(v.dim()))

    batch_norm = named("aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default")
    return {
        "ConvertToUpsampleBilinear2d": named("aten.upsample_bilinear2d.vec"),
        # Every pattern of partition/graphs/sdpa.py holds logical_not (its boolean-mask handling).
        "ConvertToSDPAPass": named("aten.logical_not.default"),
        "FuseBatchNormPass": batch_norm,
        "DecomposeBatchNorm": batch_norm,
        "Conv1dUnsqueezePass": named("aten.convolution.default"),
        "PReLUReshapePass": named("aten._prelu_kernel.default"),
        "RemoveGetItemPass": named("aten.max_pool2d_with_indices.default", "aten.max.dim"),
        # Only rewrites cats of more than 5 inputs.
        "DecomposeConcatenate": lambda n: _op_name(n) == "aten.cat.default" and len(n.args[0]) > 5,
        # Only copies metadata onto quantize/dequantize nodes.
        "PropagateCustomMetaPass": lambda n: n.op == "call_function" and (is_quant(n) or is_dequant(n)),
        "DimOrderOpsRevertPass": named(*{getattr(op, "__name__", str(op)) for op in MemoryFormatOpsMap}),
        # Folds a call only when every argument is a real tensor; in its re-trace every placeholder
        # is fake, so folding starts at a call without graph inputs (a creation op) or never.
        "ConstPropPass": lambda n: n.op == "call_function" and not n.all_input_nodes,
        # Fuses a relu/hardtanh into the op before it (not clamp).
        "FuseActivationPass": named("aten.relu.default", "aten.hardtanh.default"),
        # Removes pairs of _to_copy (the layout conversions ChannelsLastTaggedReshapePass adds).
        "RemoveRedundantCopyPass": named("aten._to_copy.default"),
        # Rewrites [add]mm/bmm of linear origin and linears next to view_copy/dequantize nodes.
        "ConvertToLinearPass": named("aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                                     "aten.linear.default"),
        # ExecuTorch's own passes.
        # Puts scalar_tensor before SymInt/SymFloat/SymBool arguments: none in a static graph.
        "SymToTensorPass": symbolic,
        "NormalizeTransposePass": lambda n: n.op == "call_function" and n.target is torch.ops.aten.t.default,
        # Replaces view ops by their _copy variants; runs after ReplaceViewOpsWithViewCopyOpsPass.
        "ReplaceBrokenOpsWithFunctionalOpsPass": lambda n: (
            n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.is_view),
        # (edge -> ExecuTorch) Copies to the default dim order a portable op's input with another.
        "LegalizePortableDimOrderPass": non_default_dim_order_input,
    }


def needed_xnnpack_passes(graph_module: torch.fx.GraphModule, passes: list) -> list:
    """The XNNPACK pass classes of `passes` that can change `graph_module` (an edge-dialect partition),
    in order: those without a trigger in `_pass_triggers` or with one that some node satisfies."""
    triggers, nodes = _pass_triggers(), list(graph_module.graph.nodes)
    return [p for p in passes if p.__name__ not in triggers or any(map(triggers[p.__name__], nodes))]


@contextlib.contextmanager
def needed_xnnpack_passes_only():
    """Within the block, XNNPACK's `preprocess` runs on each partition only the passes of its
    default list that can change that partition (`needed_xnnpack_passes`).

    WHY: each pass re-traces every partition with fake tensors whether or not it holds what the pass
    rewrites (a SHRAM step has no convolution, batch norm, PReLU, upsampling, pooling or SDPA); as
    ExecuTorch's llama export does (pytorch/executorch#1893), the list is filtered where it is built.
    """
    if not enabled("needed_xnnpack_passes"):  # off: the stock path
        yield
        return
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    init = XNNPACKPassManager.__init__

    def filtered_init(self, exported_program, passes=None):
        init(self, exported_program, passes)
        if not passes:
            self.passes = needed_xnnpack_passes(exported_program.graph_module, self.passes)

    with patched(XNNPACKPassManager, __init__=filtered_init):
        yield


class _GatedPass:
    """A pass that runs only when some node of the graph satisfies `hit`; else a no-op."""

    def __init__(self, inner, hit):
        self.inner, self.hit = inner, hit

    def __call__(self, graph_module):
        from torch.fx.passes.infra.pass_base import PassResult

        if any(self.hit(n) for n in graph_module.graph.nodes):
            return self.inner(graph_module)
        return PassResult(graph_module, False)


def _view_ops_to_copies_in_place(graph_module) -> bool | None:
    """torch's `ReplaceViewOpsWithViewCopyOpsPass` as a change of targets in place (each ATen view op
    becomes its `_copy` variant); returns whether any node changed, None if left for the stock pass.

    WHY safe: node values keep the views' strides until the fused re-trace; before it only `to_edge`'s
    `RemoveToCopyPass` reads a stride (dropping a same-dtype `_to_copy` whose input and output strides
    agree), and decides the same unless the input is a non-dense view or the `_to_copy` asks for a
    layout. A graph with such a `_to_copy`, or with a higher-order op, is left untouched.
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
def edge_program_passes():
    """Within the block, `to_edge` and `to_executorch` skip the passes that cannot change the graph
    (`_pass_triggers`; accelerator `needed_edge_passes`), and `to_edge` runs its four per-operator
    conversion passes in one re-trace per method (`one_edge_conversion_trace`).

    WHY the skips: each such pass is an `ExportPass` re-tracing every node with fake tensors to rewrite
    a few ops a static SHRAM step lacks (`aten.t`, a SymInt argument). WHY the fusion: the four
    (`_PER_OP_EDGE_PASSES`) each re-trace every node and override only `call_operator`, so one class
    deriving from all four, in `to_edge`'s order, applies them to each call in turn; the clean-ups
    between the first two match nothing a scalar turned into a tensor makes, so they run first. The
    `_program` attributes are replaced here only, from the stock ones read on entry; restored on exit.
    """
    gate, fuse = enabled("needed_edge_passes"), enabled("one_edge_conversion_trace")
    if not (gate or fuse):  # off: the stock path
        yield
        return
    from executorch.exir.program import _program

    stock = {n: getattr(_program, n) for n in ("_get_aten_to_edge_passes", "edge_to_executorch_passes")}
    triggers = _pass_triggers() if gate else {}

    def gated(passes):
        return [_GatedPass(p, triggers[pass_name(p)]) if pass_name(p) in triggers else p for p in passes]

    def aten_to_edge(config):
        pre, post = stock["_get_aten_to_edge_passes"](config)
        return gated(pre), gated(post)

    def to_executorch(*args, **kwargs):
        return gated(stock["edge_to_executorch_passes"](*args, **kwargs))

    patches = {"_get_aten_to_edge_passes": aten_to_edge, "edge_to_executorch_passes": to_executorch}
    patches = patches if gate else {}
    if fuse:
        patches["_generate_edge_program"] = _fused_generate(_program, aten_to_edge)
    with patched(_program, **patches):
        yield


def _fused_generate(_program, aten_to_edge):
    """`_program._generate_edge_program` with `aten_to_edge`'s per-operator passes fused and the view-to-copy
    pass done in place (it reads the pass classes and list when it runs: swapped per call)."""
    from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass
    from torch.fx.passes.infra.pass_base import PassBase, PassResult

    from executorch.exir.passes.memory_format_ops_pass import MemoryFormatOpsPass
    from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators
    from executorch.exir.passes.replace_aten_with_edge_pass import OpReplacePass
    from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass

    generate = _program._generate_edge_program

    class AlreadyApplied(PassBase):
        def call(self, graph_module):
            return PassResult(graph_module, False)

    class ViewOpsToCopiesInPlace(PassBase):
        def call(self, graph_module):
            changed = _view_ops_to_copies_in_place(graph_module)
            if changed is None:
                return ReplaceViewOpsWithViewCopyOpsPass()(graph_module)
            return PassResult(graph_module, changed)

    def without_fused(cfg):
        pre, post = aten_to_edge(cfg)
        return [p for p in pre if pass_name(p) not in _PER_OP_EDGE_PASSES], post

    def generate_fused(config, *args, **kwargs):
        bases = (ScalarToTensorPass, RemoveMixedTypeOperators, OpReplacePass)
        if not config._skip_dim_order:  # to_edge runs MemoryFormatOpsPass only then
            bases += (MemoryFormatOpsPass,)
        with patched(_program, _get_aten_to_edge_passes=without_fused, MemoryFormatOpsPass=AlreadyApplied,
                     OpReplacePass=type("FusedEdgeConversionPass", bases, {}),
                     ReplaceViewOpsWithViewCopyOpsPass=ViewOpsToCopiesInPlace):
            return generate(config, *args, **kwargs)

    return generate_fused
