"""Scratch buffers of a compiled step, allocated once instead of on every call.

Inductor's Python wrapper allocates every intermediate buffer of a step on each call
(`empty_strided_cpu`, then views of it with `reinterpret_tensor`) and frees it on return: ~50
buffers and ~15 views per decoder layer, freshly page-faulted when large. A SHRAM step has
fixed shapes, so these are the same buffers on every call. `hoist_scratch` rewrites a wrapper
module's functions so that each scratch buffer whose shape is a literal, and each view of one,
is made once, when the module is rewritten, and reused by every later call. Buffers a function
returns (and everything they are views or aliases of) stay fresh per call: a step's logits
never share memory with the next step's. The rewritten entry point holds a lock, because
modules are shared by every compile of the same graph and two threads calling one at once
would share its scratch.

WHY a source transformation of Inductor's generated code: Inductor has no setting that keeps
a CPU step's intermediates between calls (`memory_planning` pools them per call through one
Python call per buffer, which is slower), and its C++ wrapper cannot compile the nested layer
region and, with the layers unrolled, was slower (docs/performance.md). The rewrite reads
Inductor's private wrapper format and `PyCodeCache.modules`, so it is the accelerator `persistent_scratch`
(shram_static/accelerators.py): on torch releases it was not verified on, or under
`SHRAM_STATIC_STOCK`, the generated code runs as Inductor wrote it.
"""

import ast
import inspect
import logging
import threading

from .accelerators import enabled
from .kernel_builds import run_batched

log = logging.getLogger(__name__)

_ALLOC, _VIEW = "empty_strided_cpu", "reinterpret_tensor"
_DONE = "_shram_scratch_done"  # set on a module once rewritten (modules are shared per source)
_LOCK = "_shram_scratch_lock"


def compiled_call(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` for a call of a compiled step that may compile (a first call, or
    one with its guards checked): its kernels built in batches (`kernel_builds.run_batched`),
    and every Inductor wrapper module loaded during the call with its scratch hoisted
    (`hoist_scratch`) where the accelerator `persistent_scratch` is on.

    Args:
        fn: the compiled step.
        *args, **kwargs: its inputs.

    Returns:
        What `fn` returns.
    """
    if not enabled("persistent_scratch"):
        return run_batched(fn, *args, **kwargs)
    from torch._inductor.codecache import PyCodeCache
    n = len(PyCodeCache.modules)
    try:
        return run_batched(fn, *args, **kwargs)
    finally:
        for mod in PyCodeCache.modules[n:]:
            hoist_scratch(mod)


def hoist_scratch(mod) -> int:
    """Rewrites the wrapper functions of one Inductor output module so that their scratch
    buffers are allocated once (see the module docstring). Idempotent; a module whose source
    cannot be read or parsed is left as it is.

    Args:
        mod: a module from `torch._inductor.codecache.PyCodeCache`.

    Returns:
        The number of allocations and views hoisted (0 if none, or already rewritten).
    """
    if getattr(mod, _DONE, False):
        return 0
    setattr(mod, _DONE, True)
    try:
        return _rewrite(mod)
    except Exception as e:  # noqa: BLE001 -- code we did not expect: it runs as Inductor wrote it
        log.debug("scratch not hoisted in %s: %r", getattr(mod, "__name__", mod), e)
        return 0


def _rewrite(mod) -> int:
    tree = ast.parse(inspect.getsource(mod))
    filename = inspect.getsourcefile(mod)
    fns = []  # (FunctionDef, the live function object, is the entry point)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and [a.arg for a in node.args.args] == ["args"]:
            fns.append((node, getattr(mod, node.name, None), node.name == "call"))
        elif isinstance(node, ast.ClassDef) and node.name == "Runner":
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "call":
                    fns.append((f, getattr(getattr(mod, "Runner", None), "call", None), True))
    if not any(entry for *_, entry in fns) or any(live is None for _, live, _ in fns):
        return 0
    g = mod.__dict__
    g.setdefault(_LOCK, threading.Lock())
    rewritten, total = [], 0
    for node, live, entry in fns:
        plan = _plan(node)
        if not plan and not entry:
            continue
        gmap = {}
        for i, name in plan:
            st = node.body[i]
            gmap[name] = f"_shram_scratch_{node.name}_{name}"
            if st.value.func.id == _VIEW:
                st.value.args[0] = ast.Name(gmap[st.value.args[0].id], ast.Load())
            g[gmap[name]] = eval(compile(ast.fix_missing_locations(ast.Expression(st.value)),
                                         filename, "eval"), g)
            st.value = ast.Name(gmap[name], ast.Load())
        views = _InlineViews(gmap, node.name)  # views written inside a call's arguments
        views.visit(node)
        for gname, expr in views.made.items():
            g[gname] = eval(compile(ast.fix_missing_locations(ast.Expression(expr)), filename, "eval"), g)
        if entry:
            # the entry holds the module's lock: its scratch (and its subgraphs') is shared
            node.body = [ast.With([ast.withitem(ast.Name(_LOCK, ast.Load()))], node.body)]
        node.decorator_list = []
        m = ast.fix_missing_locations(ast.Module([node], []))
        ns = {}
        exec(compile(m, filename, "exec"), g, ns)
        if ns[node.name].__code__.co_freevars != live.__code__.co_freevars:
            return 0
        rewritten.append((live, ns[node.name].__code__))
        total += len(plan) + len(views.made)
    if not total:
        return 0
    for live, code in rewritten:  # in place: every reference (the compiled graph's) sees it
        live.__code__ = code
    log.debug("hoisted %d scratch allocations and views in %s", total, mod.__name__)
    return total


class _InlineViews(ast.NodeTransformer):
    """Replaces each `reinterpret_tensor(<hoisted buffer>, <literals>)` nested in a statement
    (a kernel's or subgraph's argument) by a global made once; `made`: global name -> the view."""

    def __init__(self, gmap: dict, fn: str):
        self.gmap, self.fn, self.made, self.seen = gmap, fn, {}, {}

    def visit_Call(self, call):
        self.generic_visit(call)
        base = call.args[0] if call.args else None
        if not (isinstance(call.func, ast.Name) and call.func.id == _VIEW and not call.keywords
                and isinstance(base, ast.Name) and base.id in self.gmap and _literal(call.args[1:])):
            return call
        key = ast.dump(call)
        if key not in self.seen:
            gname = self.seen[key] = f"_shram_scratch_{self.fn}_view{len(self.seen)}"
            self.made[gname] = ast.Call(call.func, [ast.Name(self.gmap[base.id], ast.Load()), *call.args[1:]], [])
        return ast.Name(self.seen[key], ast.Load())


def _names(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _plan(fn: ast.FunctionDef) -> list:
    """(statement index, name) of the allocations and views in `fn` that can be made once:
    a top-level `name = empty_strided_cpu(<literals>)` or `name = reinterpret_tensor(<one of
    those>, <literals>)`, assigned once, that nothing the function returns derives from."""
    deps, assigned = {}, {}
    for st in ast.walk(fn):
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            for t in targets:
                for n in _names(t):
                    deps.setdefault(n, set()).update(_names(st.value) if st.value else ())
                    assigned[n] = assigned.get(n, 0) + 1
        elif (isinstance(st, ast.Call) and isinstance(st.func, ast.Attribute)
              and isinstance(st.func.value, ast.Name)):  # x.append(buf) and the like
            deps.setdefault(st.func.value.id, set()).update(*map(_names, st.args))
    escaped, todo = set(), [n for r in ast.walk(fn) if isinstance(r, (ast.Return, ast.Yield))
                            and r.value is not None for n in _names(r.value)]
    while todo:
        n = todo.pop()
        if n not in escaped:
            escaped.add(n)
            todo.extend(deps.get(n, ()))
    plan, made = [], set()
    for i, st in enumerate(fn.body):
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Name)
                and not st.value.keywords and st.value.args):
            continue
        name, call = st.targets[0].id, st.value
        if name in escaped or assigned.get(name) != 1:
            continue
        base, rest = call.args[0], call.args[1:]
        if ((call.func.id == _ALLOC and _literal(call.args))
                or (call.func.id == _VIEW and isinstance(base, ast.Name) and base.id in made and _literal(rest))):
            plan.append((i, name))
            made.add(name)
    return plan


def _literal(args) -> bool:
    """Every argument a constant (sizes, strides, offset) or a `torch.<dtype>`."""
    for a in args:
        if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "torch":
            continue
        try:
            ast.literal_eval(a)
        except ValueError:
            return False
    return True
