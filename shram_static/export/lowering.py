"""What makes lowering a SHRAM step (ExecuTorch, ONNX) cheaper without changing the program.

Lowering cost is per graph node and per pass (`export/probes/README.md`, section 7): every
pass re-traces the graph, XNNPACK's `preprocess` runs its 17 passes on every partition, and
the ONNX exporter's optimizer tries each of its ~46 rewrite rules at every node. Each helper
here removes work whose result is thrown away, and says why it is safe.
"""

import contextlib

import torch


def drop_provenance(ep) -> None:
    """Deletes the `from_node` provenance of every node of an exported program, in place.

    WHY: torch.fx records, on every node a pass creates, a deep copy of the whole provenance
    chain of the node it came from, so each of lowering's hundreds of passes copies chains that
    grow with every pass (profile of the built-in model: 62 of 291 s in `copy.deepcopy` under
    `fx.traceback.NodeSource`). Provenance is debugging metadata; the program does not change.
    """
    for node in ep.graph.nodes:
        node.meta.pop("from_node", None)


def drop_metadata_asserts(ep) -> None:
    """Erases torch.export's `_assert_tensor_metadata` nodes (no users), in place.

    WHY: strict export emits one per `.to(dtype)`/`.float()` (56 of the 818 nodes of the tiny
    model's decode graph, most of them same-dtype no-ops), and ExecuTorch removes them only
    after decomposing the graph three times; every pass until then re-traces them.
    """
    target = torch.ops.aten._assert_tensor_metadata.default
    for node in list(ep.graph.nodes):
        if node.op == "call_function" and node.target is target and not node.users:
            ep.graph.erase_node(node)
    ep.graph_module.recompile()


@contextlib.contextmanager
def shared_provenance():
    """Within the block, deep copies of `torch.fx.traceback.NodeSource` share it.

    WHY: every pass that re-creates a node records a NodeSource holding a deep copy of the old
    node's whole provenance chain, and lowering runs ~80 passes, so the copies grow with every
    pass (quadratic; `drop_provenance` cannot help, the chains regrow inside lowering).
    Measured on the tiny test model, decode only: 39-45 s with sharing against 55 s without.
    A NodeSource is never mutated after construction (torch 2.13: only its constructor and
    deserializer assign its fields; the per-node `from_node` lists stay distinct copies), so
    sharing records the same provenance. Restored on exit; torch is pinned (pyproject.toml).
    """
    from torch.fx.traceback import NodeSource

    missing = object()
    old = NodeSource.__dict__.get("__deepcopy__", missing)
    NodeSource.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if old is missing:
            del NodeSource.__deepcopy__
        else:
            NodeSource.__deepcopy__ = old


def _op_name(node) -> str:
    """'aten.cat.default' for an edge or aten op node, '' for anything else."""
    if node.op != "call_function":
        return ""
    return getattr(node.target, "__name__", "")


def _pass_triggers() -> dict:
    """XNNPACK pass name -> predicate on a node: the pass can change the partition only if some
    node satisfies it (read off each pass's source in executorch 1.4.1, which is pinned)."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant
    from executorch.exir.passes.dim_order_ops_registry import MemoryFormatOpsMap

    def named(*names):
        return lambda n: _op_name(n) in names

    dim_order_ops = {getattr(op, "__name__", str(op)) for op in MemoryFormatOpsMap}
    return {
        # Its patterns (partition/graphs/bilinear_2d.py) are the single upsample op.
        "ConvertToUpsampleBilinear2d": named("aten.upsample_bilinear2d.vec"),
        # Every pattern of partition/graphs/sdpa.py holds logical_not, full_like and any.dim
        # (the boolean-mask handling of F.scaled_dot_product_attention's decomposition).
        "ConvertToSDPAPass": named("aten.logical_not.default"),
        "FuseBatchNormPass": named("aten.native_batch_norm.default",
                                   "aten._native_batch_norm_legit_no_training.default"),
        "DecomposeBatchNorm": named("aten.native_batch_norm.default",
                                    "aten._native_batch_norm_legit_no_training.default"),
        "Conv1dUnsqueezePass": named("aten.convolution.default"),
        "PReLUReshapePass": named("aten._prelu_kernel.default"),
        "RemoveGetItemPass": named("aten.max_pool2d_with_indices.default", "aten.max.dim"),
        # Only rewrites cats of more than 5 inputs.
        "DecomposeConcatenate": lambda n: _op_name(n) == "aten.cat.default" and len(n.args[0]) > 5,
        # Only copies metadata onto quantize/dequantize nodes.
        "PropagateCustomMetaPass": lambda n: n.op == "call_function" and (is_quant(n) or is_dequant(n)),
        "DimOrderOpsRevertPass": lambda n: _op_name(n) in dim_order_ops,
    }


def needed_xnnpack_passes(graph_module: torch.fx.GraphModule, passes: list) -> list:
    """The passes of `passes` (classes) that can change `graph_module`: those without a trigger
    in `_pass_triggers`, and those with one that some node of the graph satisfies. Order kept.

    Args:
        graph_module: an XNNPACK partition in edge dialect.
        passes: XNNPACK pass classes, in the order XNNPACK runs them.

    Returns:
        The sub-list of `passes` to run.
    """
    triggers = _pass_triggers()
    nodes = list(graph_module.graph.nodes)
    keep = []
    for p in passes:
        hit = triggers.get(p.__name__)
        if hit is None or any(hit(n) for n in nodes):
            keep.append(p)
    return keep


@contextlib.contextmanager
def needed_xnnpack_passes_only():
    """Within the block, XNNPACK's `preprocess` runs on each partition only the passes of its
    default list that can change that partition (`needed_xnnpack_passes`).

    WHY: `preprocess` runs all 17 of its passes on every partition, and each one re-traces the
    partition with fake tensors and re-checks it, whether or not the partition holds anything
    the pass rewrites; the two pattern passes also trace their pattern graphs once per process
    (3.3 s). A SHRAM step has no convolution, batch norm, PReLU, upsampling, pooling or SDPA.
    Measured on the built-in model, decode-only `.pte`: 10 of the 17 passes were ~13 of 47 s.
    ExecuTorch's maintainers cut the same cost the same way for their llama export (pytorch/
    executorch#1893: only ConvertToLinearPass for dynamically quantized linears); the pass list
    is the only hook, so the default list is filtered where it is built. Restored on exit;
    executorch is pinned (pyproject.toml).
    """
    from executorch.backends.xnnpack import _passes

    cls = _passes.XNNPACKPassManager
    init = cls.__init__

    def filtered_init(self, exported_program, passes=None):
        init(self, exported_program, passes)
        if not passes:
            self.passes = needed_xnnpack_passes(exported_program.graph_module, self.passes)

    cls.__init__ = filtered_init
    try:
        yield
    finally:
        cls.__init__ = init


# onnxscript rewrite rules the ONNX export leaves out (see `without_onnx_rewrite_rules`).
SKIPPED_ONNX_RULES = ("SlicesSplit",)


@contextlib.contextmanager
def without_onnx_rewrite_rules(names=SKIPPED_ONNX_RULES):
    """Within the block, the ONNX exporter's optimizer (`torch.onnx.export(optimize=True)`,
    i.e. `onnxscript.optimizer.optimize_ir`) applies its default rewrite rules except `names`.

    WHY: onnxscript's `SlicesSplit` (two Slices of one tensor's last-axis halves -> one Split)
    is a two-output pattern, and its matcher is far slower than the other 45 rules together on
    a SHRAM step, which holds hundreds of Slices (cache views, RoPE halves) and never matches
    it. Measured on the bench model's decode graph: 24.5 of the 28.7 s one rewrite round takes;
    the optimizer was 116 of the 177 s of the bench model's `.onnx` export. The optimized
    graphs are otherwise what the exporter makes (tests/test_lowering.py compares the op
    histograms with and without). `optimize_ir` reads the rule tuple when it runs, so it is
    swapped for the block only; onnxscript's version is what this was measured on.
    """
    from onnxscript import rewriter

    rules = rewriter._DEFAULT_REWRITE_RULES
    keep = tuple(r for r in rules if getattr(r, "name", None) not in names)
    rewriter._DEFAULT_REWRITE_RULES = keep
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules
