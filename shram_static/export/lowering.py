"""What makes lowering a SHRAM step (ExecuTorch, ONNX) cheaper without changing the program.

Lowering cost is per graph node and per pass (docs/performance.md, "Accelerators"): every
pass re-traces the graph, XNNPACK's `preprocess` runs its 17 passes on every partition, and
the ONNX exporter's optimizer tries each of its ~46 rewrite rules at every node. Each helper
here removes work whose result is thrown away, and says why it is safe. Each is a registered
accelerator: it runs only on the releases it was verified on, and `SHRAM_STATIC_STOCK=1` turns
it off (shram_static/accelerators.py).
"""

import contextlib
import dataclasses
import logging

import torch

from ..accelerators import enabled
from .decompose import export_decomposed
from .edge_conversion import one_edge_conversion_trace, pass_name
from .recompiles import lazy_recompiles


def _op_name(node) -> str:
    """'aten.cat.default' for an edge or aten op node, '' for anything else."""
    if node.op != "call_function":
        return ""
    return getattr(node.target, "__name__", "")


def _pass_triggers() -> dict:
    """Pass name -> predicate on a node: the pass can change the graph only if some node
    satisfies it. XNNPACK's `preprocess` passes (per partition) and ExecuTorch's ATen-to-edge and
    edge-to-ExecuTorch passes (per method), read off each pass's source in the ExecuTorch releases
    the accelerators were verified on; each rewrites only the nodes named here and
    otherwise re-traces the graph."""
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
        # Folds a call only when every argument is a real tensor or a constant; in its re-trace
        # every placeholder (weights included) is a fake tensor, so folding starts at a call
        # without graph inputs (a creation op) or never. No XNNPACK pass before it makes one.
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
        # (edge -> ExecuTorch) Copies to the default dim order the input of a portable mean/sum/
        # expand/pooling that has another; a SHRAM step's tensors are all contiguous.
        "LegalizePortableDimOrderPass": non_default_dim_order_input,
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
    A SHRAM step has no convolution, batch norm, PReLU, upsampling, pooling or SDPA, so
    most of them re-trace for nothing (what that costs: docs/performance.md, "Accelerators").
    ExecuTorch's maintainers cut the same cost the same way for their llama export (pytorch/
    executorch#1893: only ConvertToLinearPass for dynamically quantized linears); the pass list
    is the only hook, so the default list is filtered where it is built. Restored on exit;
    runs only on the releases it was verified on (shram_static/accelerators.py).
    """
    if not enabled("needed_xnnpack_passes"):  # off: the stock path
        yield
        return
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


class _GatedPass:
    """A pass that runs only when some node of the graph satisfies `hit`; else a no-op."""

    def __init__(self, inner, hit):
        self.inner, self.hit = inner, hit

    def __call__(self, graph_module):
        from torch.fx.passes.infra.pass_base import PassResult

        if any(self.hit(n) for n in graph_module.graph.nodes):
            return self.inner(graph_module)
        return PassResult(graph_module, False)


@contextlib.contextmanager
def needed_edge_passes_only():
    """Within the block, ExecuTorch's ATen-to-edge conversion (`to_edge`) and its edge-to-ExecuTorch
    passes (`to_executorch`) skip the passes that cannot change the graph (`_pass_triggers`).

    WHY: each of those passes is an `ExportPass` that re-traces every node of the graph with
    fake tensors to rewrite a few ops a static SHRAM step does not hold (`aten.t`, a SymInt
    argument, a view op left after the view-to-copy pass). The pass lists are read from
    `_get_aten_to_edge_passes` and `edge_to_executorch_passes` when a method is converted, so
    those functions are wrapped for the block only;
    runs only on the releases it was verified on (shram_static/accelerators.py).
    """
    if not enabled("needed_edge_passes"):  # off: the stock path
        yield
        return
    from executorch.exir.program import _program

    get = _program._get_aten_to_edge_passes
    triggers = _pass_triggers()

    def gated(passes):
        return [_GatedPass(p, triggers[pass_name(p)]) if pass_name(p) in triggers else p for p in passes]

    def filtered(config):
        pre, post = get(config)
        return gated(pre), gated(post)

    to_et = _program.edge_to_executorch_passes

    def filtered_to_et(*args, **kwargs):
        return gated(to_et(*args, **kwargs))

    _program._get_aten_to_edge_passes = filtered
    _program.edge_to_executorch_passes = filtered_to_et
    try:
        yield
    finally:
        _program._get_aten_to_edge_passes = get
        _program.edge_to_executorch_passes = to_et


def _can_merge_partitions(self, p1, p2, partitions_by_id) -> bool:
    """`GroupBasedPartitioner._can_merge_partitions` of executorch 1.4-1.5 with the same answer:
    two partitions merge unless a node outside both, fed by one of them, feeds one of them
    back (a cycle), checked on the precomputed dependency sets and then on the live graph.

    The stock method tests each external user's downstream set with a Python generator over
    the whole set; `isdisjoint` asks the same question in C over the smaller set.
    """
    from torch.fx.passes.utils.fuser_utils import validate_partition

    combined = set(partitions_by_id[p1].nodes) | set(partitions_by_id[p2].nodes)
    for node in combined:
        for user in node.users:
            if user not in combined and not self.dependency_viewer.downstreams_of(user).isdisjoint(combined):
                return False
    return validate_partition(list(combined))


def _legalize_order(gm) -> list:
    """The node order `torch.fx.passes.tools_common.legalize_graph` (torch 2.13-2.14) gives
    `gm`: Kahn's algorithm over a deque, runtime-assertion and scalar ops first."""
    import collections
    import operator

    prioritized = {operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv,
                   operator.mod, operator.le, operator.lt, operator.ge, operator.gt, operator.eq,
                   operator.ne, torch.ops.aten.sym_constrain_range.default,
                   torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten._assert_async.msg,
                   torch.ops.aten.scalar_tensor.default, torch.ops.aten._assert_scalar.default}
    nodes = list(gm.graph.nodes)
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(n for n in nodes if indeg[n] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in prioritized:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        raise RuntimeError(f"Input graph has cycles, unable to add {[n for n in indeg if indeg[n] != 0]}")
    return order


@contextlib.contextmanager
def faster_partitioning():
    """Within the block, ExecuTorch's partitioning of a graph into delegates gives the same
    partitions and the same graph in time linear, not quadratic, in the partition count.

    WHY: in a profile of the bench model's `.pte` lowering, most of `to_backend` outside
    XNNPACK's preprocessing was two quadratic steps. (1) `GroupBasedPartitioner`
    tries to merge every pair of candidate partitions, each try scanning whole downstream sets
    in a Python generator: `_can_merge_partitions` answers the same with
    `set.isdisjoint`. (2) `create_submodule_from_nodes` calls `legalize_graph` after cutting
    out each delegate, which copies every node of the whole graph into a new one
    and regenerates its Python code: the same order is applied to the same nodes in place, and
    the code is regenerated once per graph when the block ends (nothing runs the graph module
    in between: delegates are cut from and lowered off its `graph`). Both functions are read
    when called, so they are swapped for the block only;
    runs only on the releases it was verified on (shram_static/accelerators.py).
    """
    if not enabled("linear_partitioning"):  # off: the stock path
        yield
        return
    from executorch.exir import lowered_backend_module as lbm
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

    touched = {}

    def legalize_in_place(gm):
        cursor = gm.graph._root
        for node in _legalize_order(gm):
            if cursor._next is not node:
                cursor.append(node)
            cursor = node
        touched[id(gm)] = gm
        return gm

    merge, legalize = GroupBasedPartitioner._can_merge_partitions, lbm.legalize_graph
    GroupBasedPartitioner._can_merge_partitions = _can_merge_partitions
    lbm.legalize_graph = legalize_in_place
    try:
        yield
    finally:
        GroupBasedPartitioner._can_merge_partitions, lbm.legalize_graph = merge, legalize
        for gm in touched.values():
            gm.recompile()


# onnxscript rewrite rules the ONNX export leaves out (see `without_onnx_rewrite_rules`).
SKIPPED_ONNX_RULES = ("SlicesSplit",)


@contextlib.contextmanager
def without_onnx_rewrite_rules(names=SKIPPED_ONNX_RULES):
    """Within the block, the ONNX exporter's optimizer (`torch.onnx.export(optimize=True)`,
    i.e. `onnxscript.optimizer.optimize_ir`) applies its default rewrite rules except `names`.

    WHY: onnxscript's `SlicesSplit` (two Slices of one tensor's last-axis halves -> one Split)
    is a two-output pattern, and its matcher is far slower than the other 45 rules together on
    a SHRAM step, which holds hundreds of Slices (cache views, RoPE halves) and never matches
    it: most of an optimizer round on the bench model's decode graph, and the optimizer is most
    of an `.onnx` export (docs/performance.md, "Accelerators"). The optimized
    graphs are otherwise what the exporter makes (tests/test_onnx_lowering.py compares the op
    histograms with and without). `optimize_ir` reads the rule tuple when it runs, so it is
    swapped for the block only;
    runs only on the releases it was verified on (shram_static/accelerators.py).
    """
    if not enabled("skip_onnx_slices_split"):  # off: the stock path
        yield
        return
    from onnxscript import rewriter

    rules = rewriter._DEFAULT_REWRITE_RULES
    keep = tuple(r for r in rules if getattr(r, "name", None) not in names)
    rewriter._DEFAULT_REWRITE_RULES = keep
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def export_and_lower(methods: dict, partitioner, constant_methods: dict, compile_config):
    """`torch.export.export` of each method, then `executorch.exir.to_edge_transform_and_lower`,
    with one trace per method for export and decomposition (`export_decomposed`) where the
    stock call takes four; when that would not give the stock program, the stock calls.

    WHY: the stock call, for a partitioner that checks op support (XNNPACK's does), runs
    `run_decompositions` three times per method (functionalize; decompose all but the ops the
    partitioner asks to keep; decompose again those of the kept ops it then rejects), each a
    full re-trace of the graph after export's own. ExecuTorch's public two-step flow (`to_edge` with
    `EdgeCompileConfig.preserve_ops`, then `to_backend`) functionalizes and decomposes in one
    pass, here fused with the export's trace. The only difference is for a kept op the
    partitioner would then reject (e.g. a linear XNNPACK cannot take): the stock call decomposes
    it, the two-step flow would leave it whole. So each kept op of the edge graph is checked
    with the partitioner's own support check first, and any rejection falls back to the stock
    calls (never taken by a SHRAM step: every kept op is a delegated linear or torchao quant op).

    Args:
        methods: method name -> (module, example positional inputs); traced with strict=False
            under no_grad.
        partitioner: one partitioner for every method.
        constant_methods: as for `to_edge_transform_and_lower`.
        compile_config: an `EdgeCompileConfig`; its `preserve_ops` is extended, not replaced.

    Returns:
        The lowered `EdgeProgramManager`.
    """
    from executorch.exir import EdgeProgramManager
    from executorch.exir.program import _program

    if not enabled("one_trace_lowering"):
        return _stock_lower(methods, partitioner, constant_methods, compile_config)
    # The ops the partitioner keeps whole, as the stock call asks for them (a configuration
    # partitioner's list does not depend on the program; its support check, below, does).
    kept = partitioner.ops_to_not_decompose(None)[0]
    table = _program._default_decomposition_table()
    for op in [*compile_config.preserve_ops, *kept]:
        table.pop(op, None)
    programs = {name: export_decomposed(mod, args, table) for name, (mod, args) in methods.items()}
    present = {n.target for ep in programs.values() for n in ep.graph.nodes if n.op == "call_function"}
    keep = [op for op in kept if op in present]
    config = dataclasses.replace(compile_config, preserve_ops=list(compile_config.preserve_ops) + keep)
    # `to_edge` without its `run_decompositions` (done above, with the same table).
    edge = EdgeProgramManager({name: _program._generate_edge_program(config, ep, preserve_ops=config.preserve_ops)
                               for name, ep in programs.items()}, constant_methods, config)
    for name in programs:
        ep = edge.exported_program(name)
        _, supported = partitioner.ops_to_not_decompose(ep)
        for n in ep.graph.nodes:
            # An edge op wraps its ATen op in `_op`.
            if n.op == "call_function" and getattr(n.target, "_op", n.target) in keep \
                    and not (supported is None or supported(n)):
                return _stock_lower(methods, partitioner, constant_methods, compile_config)
    # The XNNPACK partitioner logs a deprecation notice for to_edge + to_backend, advising the
    # stock call for its support filter; that filter is applied above, so the notice is dropped.
    log = logging.getLogger("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    quiet = lambda record: "DEPRECATION WARNING" not in record.getMessage()  # noqa: E731 (a callable filter)
    log.addFilter(quiet)
    try:
        return edge.to_backend(partitioner)
    finally:
        log.removeFilter(quiet)



def _stock_lower(methods: dict, partitioner, constant_methods: dict, compile_config):
    """What `export_and_lower` stands for: `torch.export.export` of each method, then ExecuTorch's
    `to_edge_transform_and_lower`."""
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad():
        aten = {name: torch.export.export(mod, args, strict=False) for name, (mod, args) in methods.items()}
    return to_edge_transform_and_lower(aten, partitioner=[partitioner], compile_config=compile_config,
                                       constant_methods=constant_methods)


@contextlib.contextmanager
def lowering_speedups():
    """Within the block, every speed-up of this module and of `recompiles` that leaves the lowered
    program as it is (what `pte.lower_program` lowers and emits under; the tests compare its bytes
    with the stock lowering's)."""
    with lazy_recompiles(), needed_edge_passes_only(), one_edge_conversion_trace(), needed_xnnpack_passes_only(), \
            faster_partitioning():
        yield
