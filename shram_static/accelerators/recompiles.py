"""torch.fx's code generation deferred during a lowering (`lazy_recompiles`)."""

import contextlib
import weakref

from .registry import enabled, patched


@contextlib.contextmanager
def lazy_recompiles():
    """Within the block, `GraphModule.recompile` only marks the module: its code is generated when first
    needed (its forward called, its `code` or `recompile()`'s result read) or at the end of the block.

    WHY: ExecuTorch's and XNNPACK's passes recompile after every change and around every pass, but
    lowering runs graphs through interpreters, never their generated code. torch's `_LazyGraphModule`
    does this only for modules made by `_make_graph_module`; ExecuTorch makes plain GraphModules.
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

    class LazyCode:  # what `recompile()` returns in the block: its `PythonCode`, made on first use

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
    try:
        with patched(GraphModule, recompile=lazy, code=property(current(code.fget)), __str__=current(text)):
            yield
    finally:
        for gm in list(pending):
            realize(gm)
