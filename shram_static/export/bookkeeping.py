"""Bookkeeping of torch.fx and of ExecuTorch's serializer that a lowering repeats without using
the repeats: made cheaper for the duration of a lowering, without changing any graph or program
(each helper says why that holds).
"""

import contextlib
import functools
import typing
import weakref

from ..accelerators import enabled


@contextlib.contextmanager
def shared_provenance():
    """Within the block, deep copies of `torch.fx.traceback.NodeSource` share it.

    WHY: every pass that re-creates a node records a NodeSource holding a deep copy of the old
    node's whole provenance chain, and lowering runs ~80 passes, so the copies grow with every
    pass (quadratic; `drop_provenance` cannot help, the chains regrow inside lowering).
    A NodeSource is never mutated after construction (torch 2.13: only its constructor and
    deserializer assign its fields; the per-node `from_node` lists stay distinct copies), so
    sharing records the same provenance. Restored on exit;
    runs only on the releases it was verified on (shram_static/accelerators.py).
    """
    if not enabled("shared_provenance"):  # off: the stock path
        yield
        return
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


@contextlib.contextmanager
def lazy_recompiles():
    """Within the block, `GraphModule.recompile` only marks the module: its Python code is
    generated when first needed (its forward called, its `code` read) or at the end of the
    block, whichever comes first; a module recompiled ten times and never run in between
    generates its code once.

    WHY: ExecuTorch's and XNNPACK's passes recompile after every change, and ExecuTorch's pass
    manager again around every pass (to lint it), but lowering runs graphs through
    interpreters, never through their generated code (`Graph.python_code` was a large share of
    a profiled lowering: docs/performance.md, "Accelerators"). torch's own
    `_LazyGraphModule` (what Inductor uses) does this, but only for modules made through
    `torch.fx._lazy_graph_module._make_graph_module`; ExecuTorch makes plain GraphModules.
    As there, the lazy `forward` recompiles on its first call, so a module that is run gets
    the code of its current graph; at the end of the block every module still pending is
    recompiled, so nothing outside it sees a stale one. Inside the block `recompile()` returns
    a stand-in that generates the `PythonCode` when a caller reads it.
    """
    if not enabled("lazy_recompiles"):  # off: the stock path
        yield
        return
    from torch.fx import GraphModule
    from torch.fx.graph import _PyTreeCodeGen

    real, code, text = GraphModule.recompile, GraphModule.code, GraphModule.__str__
    pending = weakref.WeakSet()

    def realize(gm):
        pending.discard(gm)
        return real(gm)

    def lazy_forward(self, *args, **kwargs):
        realize(self)
        return self(*args, **kwargs)

    class LazyCode:
        """What `recompile()` returns in the block: its `PythonCode`, generated on first use."""

        def __init__(self, gm):
            self.gm, self.code = gm, None

        def __getattr__(self, name):
            if self.code is None:
                self.code = realize(self.gm)
            return getattr(self.code, name)

    def lazy(self):
        # the pytree specs, as `recompile` sets them (torch.export reads them off the module)
        if isinstance(self._graph._codegen, _PyTreeCodeGen):
            self._in_spec = self._graph._codegen.pytree_info.in_spec
            self._out_spec = self._graph._codegen.pytree_info.out_spec
        pending.add(self)
        type(self).forward = lazy_forward  # each GraphModule has a class of its own
        return LazyCode(self)

    def current(method):
        def run(self, *args):
            if self in pending:
                realize(self)
            return method(self, *args)
        return run

    # `code` and `str()` read the generated code (ExecuTorch formats a module into a debug log
    # message whether or not debug logging is on).
    GraphModule.recompile, GraphModule.code, GraphModule.__str__ = lazy, property(current(code.fget)), current(text)
    try:
        yield
    finally:
        GraphModule.recompile, GraphModule.code, GraphModule.__str__ = real, code, text
        for gm in list(pending):
            realize(gm)


@contextlib.contextmanager
def cached_type_hints():
    """Within the block, ExecuTorch's JSON encoder of its schema dataclasses (the program and
    each XNNPACK delegate's graph, on their way to `flatc`) looks up each class's type hints
    once, not once per field of every object.

    WHY: `_DataclassEncoder.default` calls `typing.get_type_hints(type(o))` for every field it
    writes, tens of thousands of calls for one program. A class's
    hints do not change while it is being written; the JSON is the same.
    """
    if not enabled("cached_type_hints"):  # off: the stock path
        yield
        return
    from executorch.exir._serialize import _dataclass

    hints = _dataclass.get_type_hints
    _dataclass.get_type_hints = functools.cache(typing.get_type_hints)
    try:
        yield
    finally:
        _dataclass.get_type_hints = hints


@contextlib.contextmanager
def mutable_buffers_listed_once():
    """Within the block, each run of ExecuTorch's memory planning pass works out which
    placeholders are mutated state buffers once per graph signature, not once per node it asks
    about.

    WHY: ExecuTorch's `memory_planning._is_mutable_buffer` (1.4-1.5) reads the signature's
    `inputs_to_buffers` and `buffers_to_mutate`, properties that build a dict over every input
    (output) on each read, for every node planning visits: 4550 calls for the built-in `.pte`
    (thousands of calls per method). The answer depends only on the
    signature, which planning reads and never changes, so during one `MemoryPlanningPass.run`
    the set of mutated buffers' placeholder names is built once per signature and the same
    question is answered from it; outside a run the stock function answers. Both are read when
    called, so they are swapped for the block only;
    runs only on the releases it was verified on (shram_static/accelerators.py).
    """
    if not enabled("mutable_buffers_listed_once"):  # off: the stock path
        yield
        return
    from executorch.exir import memory_planning
    from executorch.exir.passes.memory_planning_pass import MemoryPlanningPass

    stock, run = memory_planning._is_mutable_buffer, MemoryPlanningPass.run
    listed: dict[int, tuple] = {}  # id(signature) -> (signature, placeholder names), one run
    depth = [0]

    def is_mutable_buffer(node, graph_signature=None) -> bool:
        if graph_signature is None or not depth[0]:
            return stock(node, graph_signature)
        entry = listed.get(id(graph_signature))
        if entry is None or entry[0] is not graph_signature:
            mutated = set(graph_signature.buffers_to_mutate.values())
            names = {p for p, fqn in graph_signature.inputs_to_buffers.items() if fqn in mutated}
            entry = listed[id(graph_signature)] = (graph_signature, names)
        return node.op == "placeholder" and isinstance(node.target, str) and node.target in entry[1]

    def planning_run(self, graph_module, graph_signature=None):
        depth[0] += 1
        try:
            return run(self, graph_module, graph_signature)
        finally:
            depth[0] -= 1
            if not depth[0]:
                listed.clear()

    memory_planning._is_mutable_buffer, MemoryPlanningPass.run = is_mutable_buffer, planning_run
    try:
        yield
    finally:
        memory_planning._is_mutable_buffer, MemoryPlanningPass.run = stock, run
