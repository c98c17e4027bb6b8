"""The lowering speed-ups (`shram_static.accelerators`): each applies inside its block only,
and the XNNPACK pass filter drops a pass only when the partition holds nothing it rewrites.

That the lowered programs stay right is checked by running them (tests/test_export_pte.py:
golden logits and tokens through every `.pte`), and a golden model's program is compared with
the stock lowering's byte for byte in tests/test_accelerators.py.
"""

import copy
import operator
import types
import unittest.mock

import torch

from helpers import LOWERING_ACCELERATORS, needs


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

    from shram_static.accelerators.edge_passes import needed_xnnpack_passes

    default = _default_passes()
    names = [p.__name__ for p in default]
    plain = [p.__name__ for p in needed_xnnpack_passes(_graph((exir_ops.edge.aten.neg.default, ())), default)]
    # Passes without a trigger always run, in XNNPACK's order.
    assert "ChannelsLastTaggedReshapePass" in plain
    assert plain == [n for n in names if n in plain]
    for skipped in ("ConstPropPass", "ConvertToUpsampleBilinear2d", "ConvertToSDPAPass", "DecomposeBatchNorm",
                    "FuseBatchNormPass", "Conv1dUnsqueezePass", "PReLUReshapePass", "RemoveGetItemPass",
                    "DecomposeConcatenate", "PropagateCustomMetaPass", "DimOrderOpsRevertPass",
                    "ConvertToLinearPass", "FuseActivationPass", "RemoveRedundantCopyPass"):
        assert skipped not in plain
    # A node a pass acts on brings it back.
    for op, args, name in ((exir_ops.edge.aten.relu.default, (), "FuseActivationPass"),
                           (exir_ops.edge.aten.linear.default, (None,), "ConvertToLinearPass"),
                           (exir_ops.edge.aten.bmm.default, (None,), "ConvertToLinearPass"),
                           (exir_ops.edge.aten._to_copy.default, (), "RemoveRedundantCopyPass")):
        assert name in [p.__name__ for p in needed_xnnpack_passes(_graph((op, args)), default)], name
    conv = _graph((exir_ops.edge.aten.convolution.default, (None, None, [1], [0], [1], False, [0], 1)))
    assert "Conv1dUnsqueezePass" in [p.__name__ for p in needed_xnnpack_passes(conv, default)]
    cat6 = _graph((exir_ops.edge.aten.cat.default, None))
    assert "DecomposeConcatenate" in [p.__name__ for p in needed_xnnpack_passes(cat6, default)]
    dq = _graph((exir_ops.edge.quantized_decomposed.dequantize_per_tensor.default, (0.1, 0, -128, 127, torch.int8)))
    assert "PropagateCustomMetaPass" in [p.__name__ for p in needed_xnnpack_passes(dq, default)]
    # A call without graph inputs (a creation op) is where constant folding can start.
    full = _graph((exir_ops.edge.aten.neg.default, ()))
    with full.graph.inserting_before(next(iter(full.graph.nodes)).next):
        full.graph.call_function(exir_ops.edge.aten.full.default, ([2], 1.0))
    assert "ConstPropPass" in [p.__name__ for p in needed_xnnpack_passes(full, default)]


@needs('needed_xnnpack_passes')
def test_pass_filter_is_scoped():
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.dialects._ops import ops as exir_ops

    from shram_static.accelerators.edge_passes import needed_xnnpack_passes_only

    default = _default_passes()
    ep = types.SimpleNamespace(graph_module=_graph((exir_ops.edge.aten.relu.default, ())))
    with needed_xnnpack_passes_only():
        assert len(XNNPACKPassManager(ep).passes) < len(default)
        assert XNNPACKPassManager(ep, passes=default[:1]).passes == default[:1]  # explicit lists kept
    assert XNNPACKPassManager(ep).passes == default


@needs('lazy_recompiles')
def test_lazy_recompiles_generate_the_code_of_the_current_graph():
    """In the block a recompile generates no code until the module runs or its code is read,
    then the code of its graph as it is; on leaving, every pending module is recompiled and
    GraphModule is restored."""
    from torch.fx import GraphModule

    from shram_static.accelerators.recompiles import lazy_recompiles

    def edit(gm, fn):  # the one operation becomes `fn`
        for n in gm.graph.nodes:
            if n.op == "call_function":
                n.target = fn
        gm.recompile()

    real, python_code = GraphModule.recompile, torch.fx.Graph.python_code
    gm, x = torch.fx.symbolic_trace(lambda a: a + 1.0), torch.tensor([2.0])
    pending = torch.fx.symbolic_trace(lambda a: a + 1.0)
    generated = []
    counting = lambda self, *a, **k: generated.append(1) or python_code(self, *a, **k)  # noqa: E731
    with unittest.mock.patch.object(torch.fx.Graph, "python_code", counting), lazy_recompiles():
        assert GraphModule.recompile is not real
        for fn in (operator.sub, operator.mul):  # two edits, no run between: no code yet
            edit(gm, fn)
        assert generated == []
        assert "a * 1.0" in gm.code and torch.equal(gm(x), x * 1.0) and len(generated) == 1
        edit(gm, operator.sub)
        assert torch.equal(gm(x), x - 1.0)  # the forward of the current graph
        edit(gm, operator.truediv)
        assert "a / 1.0" in str(gm) and torch.equal(gm(x), x / 1.0)
        code = gm.recompile()
        assert "a / 1.0" in code.src  # the PythonCode, when a caller reads it
        edit(pending, operator.mul)  # left pending at the end of the block
    assert GraphModule.recompile is real
    assert "a * 1.0" in pending._code and torch.equal(pending(x), x * 1.0)


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


# ----------------------------------------------------------------------------------------
# Same program, less work: the speed-ups against ExecuTorch's stock lowering (byte for byte on
# a golden model's step: tests/test_accelerators.py)
# ----------------------------------------------------------------------------------------

class _Mixed(torch.nn.Module):
    """A step in miniature: linears, 4-D means, clamps and bmm (XNNPACK) between cumsum, topk
    and a state buffer's index_put (portable), so it lowers to several delegates."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)
        self.register_buffer("cache", torch.zeros(4, 8))
        self.register_buffer("seen", torch.zeros(1, 4, dtype=torch.bool))

    def forward(self, x, pos):
        h = self.a(x).clamp(min=0.0)  # (N, 8)
        h = h / h.reshape(-1, 1, 1, 8).mean(dim=(2, 3), keepdim=True).reshape(-1, 1)
        c = h.cumsum(-1)
        self.cache.index_put_((pos,), c[:1])
        top = torch.topk(c, 2).values  # (N, 2)
        m = torch.bmm(self.b(c)[None], self.cache.t()[None])[0]  # (N, 4)
        self.seen.copy_(self.seen | (m[:1] > 0))  # a whole-buffer write, as the step's `taken`
        # A scalar operand of a portable op, a mixed-type add and a cast: what the per-op
        # edge conversion passes rewrite (`one_edge_conversion_trace`).
        s = torch.where(m > 0, m, 0.5) * 0.5 + (pos % 3)  # (N, 4), float + int64
        return s.sum(-1, keepdim=True) * top[:, :1] + self.cache[:1, :1] + pos.float()


def _methods() -> dict:
    """The `_Mixed` module's two methods: name -> (module, example inputs)."""
    mod = _Mixed().eval()
    pos = torch.zeros(1, dtype=torch.long)
    return {n: (mod, (torch.randn(b, 8), pos)) for n, b in (("forward", 1), ("prefill", 3))}


def _exported(methods: dict) -> dict:
    """The methods as torch.export programs (what the stock lowering takes)."""
    with torch.no_grad():
        return {n: torch.export.export(mod, args, strict=False) for n, (mod, args) in methods.items()}


class _Views(torch.nn.Module):
    """Views of every kind the step makes (reshape, transpose, slice, select, unsqueeze,
    expand), and same-dtype `_to_copy`s of dense inputs, which torch's view pass keeps or drops
    alike on views and on their copies; `tail` adds one it does not."""

    def __init__(self, tail=None):
        super().__init__()
        self.tail = tail

    def forward(self, x):  # (4, 6)
        y = x[1:3].reshape(2, 6).t()  # (6, 2), dense, transposed
        z = y.to(torch.float32, copy=True) + x[0].unsqueeze(-1)[:, :1].expand(6, 2)
        z = z.to(torch.float64) * 2  # a cast that stays
        return z if self.tail is None else (z, self.tail(x))


def _view_graphs(tail=None):
    """Two copies of the decomposed graph of `_Views(tail)`."""
    with torch.no_grad():
        ep = torch.export.export(_Views(tail), (torch.randn(4, 6),), strict=False).run_decompositions({})
    return ep.graph_module, copy.deepcopy(ep.graph_module)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_view_ops_to_copies_in_place_is_torchs_pass():
    """The in-place view-to-copy rewrite gives torch's pass's targets; on a graph where a stride
    it leaves stale could change `to_edge`'s `_to_copy` clean-up (a non-dense view cast, a
    layout asked for), it changes nothing and says so, and torch's pass runs."""
    from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass

    from shram_static.accelerators.edge_passes import _view_ops_to_copies_in_place

    mine, stock = _view_graphs()
    views = [t for t in _targets(mine) if isinstance(t, torch._ops.OpOverload) and t.is_view]
    assert len(views) >= 5
    assert _view_ops_to_copies_in_place(mine) is True
    stock = ReplaceViewOpsWithViewCopyOpsPass()(stock).graph_module
    assert _targets(mine) == _targets(stock)
    assert not [t for t in _targets(mine) if isinstance(t, torch._ops.OpOverload) and t.is_view]
    for tail in (lambda x: x[:, ::2].to(torch.float32, copy=True),  # a strided slice: not dense
                 lambda x: x.t().to(torch.float32, copy=True, memory_format=torch.contiguous_format)):
        gm, before = _view_graphs(tail)
        assert torch.ops.aten._to_copy.default in _targets(gm)
        assert _view_ops_to_copies_in_place(gm) is None
        assert _targets(gm) == _targets(before)


@needs('one_trace_lowering')
def test_lowering_falls_back_when_a_kept_op_is_rejected(monkeypatch):
    """If the partitioner would reject an op it asked to keep whole, the stock call runs, on
    the methods exported by `torch.export`, the caller's partitioner, config (not the extended
    one) and constant methods (it decomposes that op; what it writes is ExecuTorch's, so it is
    not lowered here). Without a rejection the stock call is not made:
    `test_accelerators.test_stock_lowering_writes_the_same_program_and_tokens`."""
    import executorch.exir
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig

    from shram_static.accelerators import export_and_lower
    from shram_static.export.partition import xnnpack_partitioner

    keep = XnnpackPartitioner.ops_to_not_decompose

    def rejecting(self, ep):
        ops, _ = keep(self, ep)
        assert ops, "the test module must hold an op the partitioner keeps whole"
        return ops, lambda node: False

    calls = []
    methods, part, config = _methods(), xnnpack_partitioner(), EdgeCompileConfig(_check_ir_validity=False)
    monkeypatch.setattr(executorch.exir, "to_edge_transform_and_lower", lambda *a, **k: calls.append((a, k)) or "stock")
    monkeypatch.setattr(XnnpackPartitioner, "ops_to_not_decompose", rejecting)
    assert export_and_lower(methods, part, {"k": 1}, config) == "stock"
    [((programs,), kwargs)] = calls
    assert kwargs == dict(partitioner=[part], compile_config=config, constant_methods={"k": 1})
    assert config.preserve_ops == []
    want = _exported(methods)
    assert list(programs) == list(want)
    for name, ep in programs.items():  # torch.export's programs (the training IR), not decomposed ones
        assert isinstance(ep, torch.export.ExportedProgram)
        assert [str(n.target) for n in ep.graph.nodes] == [str(n.target) for n in want[name].graph.nodes]


@needs('needed_edge_passes')
def test_edge_pass_gates():
    """Each gated edge pass runs when a node it rewrites is present, and the stock pass lists
    come back after the block."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program import _program

    from shram_static.accelerators.edge_passes import _pass_triggers, edge_program_passes

    t = _pass_triggers()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    nodes = {"t": g.call_function(torch.ops.aten.t.default, (x,)),
             "view": g.call_function(torch.ops.aten.view.default, (x, [6])),
             "copy": g.call_function(torch.ops.aten.view_copy.default, (x, [6]))}
    assert t["NormalizeTransposePass"](nodes["t"]) and not t["NormalizeTransposePass"](nodes["copy"])
    assert t["ReplaceBrokenOpsWithFunctionalOpsPass"](nodes["view"])
    assert not t["ReplaceBrokenOpsWithFunctionalOpsPass"](nodes["copy"])
    assert not t["SymToTensorPass"](x)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    s = ShapeEnv().create_unbacked_symint()
    sym = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    sym.meta["val"] = s
    assert t["SymToTensorPass"](sym)
    mean = g.call_function(torch.ops.aten.mean.dim, (x, [1]))
    from executorch.exir.dialects._ops import ops as exir_ops
    mean.target = exir_ops.edge.aten.mean.dim
    assert not t["LegalizePortableDimOrderPass"](mean)
    x.meta["val"] = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert t["LegalizePortableDimOrderPass"](mean)

    get, to_et = _program._get_aten_to_edge_passes, _program.edge_to_executorch_passes
    with edge_program_passes():
        pre, _ = _program._get_aten_to_edge_passes(EdgeCompileConfig())
        assert sum(type(p).__name__ == "_GatedPass" for p in pre) == 3
    assert (_program._get_aten_to_edge_passes, _program.edge_to_executorch_passes) == (get, to_et)


@needs('linear_partitioning')
def test_legalize_order_is_torchs():
    """`faster_partitioning` orders nodes as torch's `legalize_graph` does (it is not a stable
    sort, so the in-place version must reproduce its order exactly), and is scoped."""
    from torch.fx.passes.tools_common import legalize_graph

    from executorch.exir import lowered_backend_module as lbm
    from shram_static.accelerators.partitioning import _legalize_order, faster_partitioning

    class M(torch.nn.Module):
        def forward(self, x, y):
            a, b = x + 1, y * 2
            c = a @ b.t()
            d = torch.relu(a) + c.sum()
            return d * b.mean(), c - a.sum()

    gm = torch.fx.symbolic_trace(M())
    want = [n.name for n in _legalize_order(gm)]
    assert [n.name for n in legalize_graph(copy.deepcopy(gm)).graph.nodes] == want
    with faster_partitioning():
        out = lbm.legalize_graph(gm)
        assert lbm.legalize_graph is not legalize_graph
    assert [n.name for n in out.graph.nodes] == want and lbm.legalize_graph is legalize_graph
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(gm(x, y), M()(x, y))  # code regenerated when the block ended


class _WithTable(_Mixed):
    """`_Mixed` plus a parameter read by a portable op (an embedding row), so that a parameter
    (requires_grad) is a tensor of the emitted program itself, not only of a delegate."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 8, generator=torch.Generator().manual_seed(1)))

    def forward(self, x, pos):
        return super().forward(x, pos) + torch.nn.functional.embedding(pos, self.table).sum(-1, keepdim=True)


def _without_offsets(buffer: bytes):
    """A deserialized `.pte` (program, named data: the delegates' weights) with every planned
    memory offset set to 0."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(buffer)
    for plan in pte.program.execution_plan:
        for v in plan.values:
            info = getattr(v.val, "allocation_info", None)
            if info is not None:
                info.memory_offset_low = info.memory_offset_high = 0
    return pte


@needs(*LOWERING_ACCELERATORS)
def test_a_method_lowered_elsewhere_emits_the_same_program():
    """A lowered method sent as `edge_program_to_value`, pickled and rebuilt by
    `edge_program_from_value` (what `lower_program(parallel=True)` does with the method lowered
    in a forked process) emits the same program and named data (the delegates' weights, here
    of the sent method alone) as the method itself, but for planned memory offsets (not fixed
    between processes: see `edge_transfer`); the same outputs."""
    import pickle

    from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig
    from executorch.runtime import Runtime

    from shram_static import accelerators
    from shram_static.accelerators.edge_transfer import edge_program_from_value, edge_program_to_value
    from shram_static.export.partition import xnnpack_partitioner

    mods = {"forward": _WithTable().eval(), "prefill": _WithTable().eval()}
    with torch.no_grad():  # weights of the sent method alone: its named data must travel too
        for p in mods["prefill"].parameters():
            p.mul_(1.5)
    pos = torch.ones(1, dtype=torch.long)
    config = EdgeCompileConfig(_check_ir_validity=False)
    methods = {n: (mods[n], (torch.randn(b, 8), pos)) for n, b in (("forward", 1), ("prefill", 3))}
    with accelerators.lowering():  # as lower_program
        edges = {n: accelerators.export_and_lower({n: m}, xnnpack_partitioner(), {}, config).exported_program(n)
                 for n, m in methods.items()}
    sent = edge_program_from_value(pickle.loads(pickle.dumps(edge_program_to_value(edges["prefill"]))))

    def emit(prefill):
        return EdgeProgramManager({"forward": copy.deepcopy(edges["forward"]), "prefill": prefill},
                                  constant_methods={"k": 1}, compile_config=config
                                  ).to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True)).buffer

    here, there = emit(copy.deepcopy(edges["prefill"])), emit(sent)
    flags = [v.val.requires_grad for v in _without_offsets(here).program.execution_plan[1].values
             if hasattr(v.val, "requires_grad")]
    assert any(flags)  # the table: what the transfer must keep
    assert _without_offsets(there) == _without_offsets(here)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    outs = [Runtime.get().load_program(b).load_method("prefill").execute([x, pos])[0] for b in (here, there)]
    assert torch.equal(outs[0], outs[1])


@needs('needed_xnnpack_passes', 'needed_edge_passes', 'one_edge_conversion_trace', 'linear_partitioning',
       'lazy_recompiles')
def test_lowering_patches_do_not_depend_on_the_order_they_are_entered():
    """Each lowering patch owns the attributes it replaces: entered in either order they replace
    the same attributes, give ExecuTorch the same pass lists, and restore everything on exit."""
    import contextlib

    from executorch.backends.xnnpack import _passes
    from executorch.exir import EdgeCompileConfig
    from executorch.exir import lowered_backend_module as lbm
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner
    from executorch.exir.program import _program
    from torch.fx import GraphModule

    from shram_static.accelerators.edge_passes import edge_program_passes, needed_xnnpack_passes_only
    from shram_static.accelerators.partitioning import faster_partitioning
    from shram_static.accelerators.recompiles import lazy_recompiles

    watched = [(_program, n) for n in ("_get_aten_to_edge_passes", "edge_to_executorch_passes",
                                       "_generate_edge_program", "OpReplacePass", "MemoryFormatOpsPass")]
    watched += [(_passes.XNNPACKPassManager, "__init__"), (GroupBasedPartitioner, "_can_merge_partitions"),
                (lbm, "legalize_graph"), (GraphModule, "recompile")]
    stock = [getattr(o, n) for o, n in watched]
    seen = []
    patches = [lazy_recompiles, edge_program_passes, needed_xnnpack_passes_only, faster_partitioning]
    for order in (patches, patches[::-1]):
        with contextlib.ExitStack() as stack:
            for p in order:
                stack.enter_context(p())
            replaced = [n for (o, n), s in zip(watched, stock) if getattr(o, n) is not s]
            pre, post = _program._get_aten_to_edge_passes(EdgeCompileConfig())
            seen.append((replaced, [type(p).__name__ for p in pre + post]))
        assert [getattr(o, n) for o, n in watched] == stock
    assert seen[0] == seen[1] and len(seen[0][0]) == 7  # not the two pass classes swapped per call
