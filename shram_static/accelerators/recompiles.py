"""torch.fx's code generation deferred during a lowering: ExecuTorch recompiles a graph module
after every pass and never runs its generated code (`lazy_recompiles`, accelerator
`lazy_recompiles`; one of `accelerators.lowering()`).
"""

import contextlib
import weakref

from .registry import enabled


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
