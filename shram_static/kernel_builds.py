"""The C++ kernels of one compiled step built as a few files, not one file each.

In its Python-wrapper mode Inductor builds every C++ kernel of a graph as its own shared
library: the generated wrapper module calls `AsyncCompile.cpp_pybinding(argtypes, source)`
once per kernel (one g++ run each, `compile_threads` at a time) and `AsyncCompile.wait` before
the graph first runs. Each g++ run pays a fixed cost, most of it instantiating the templates of
`cpp_prefix.h`, which its precompiled header leaves to every translation unit; with a cold
compile cache (a new user's first run) that fixed cost is a large share of a step's C++ build
time (docs/performance.md, "Accelerators").

Inside `batched_builds()`, the kernels one wrapper module asks for are collected instead, and
built when its `wait` (or anything else) first needs one: split into `compile_threads` files
of about equal size (so the builds still run side by side), each file the kernels' own sources
with the entry function renamed `kernel_<i>`, and Python bindings made by Inductor's own
template, built and loaded through Inductor's `CppPythonBindingsCodeCache` (same flags, same
on-disk cache). A kernel whose source does not allow the renaming, or a file that fails to
build or load, is built the way Inductor builds it (the failed file costs its build time once;
the kernels run are always Inductor's own code). Outside the context, and with one compile
thread, Inductor's path is untouched: the patch is process-wide but only acts where a caller
enters the context (the steps of a `StaticDecoder`, `shram-static train --compile`).

Registered as the accelerator `batched_kernel_builds` (shram_static/accelerators.py): with
another torch than it was verified on, or with `SHRAM_STATIC_STOCK=1`, the context does nothing.
"""

import contextlib
import functools
import logging
import re
import threading

from .accelerators import enabled

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"\bvoid\s+kernel\s*\(")  # the definition of Inductor's entry function
_NAME = re.compile(r"\bkernel\b")
_local = threading.local()  # .depth: nesting of batched_builds() on this thread
_lock = threading.Lock()
_original = None  # Inductor's AsyncCompile.cpp_pybinding, once patched


@contextlib.contextmanager
def batched_builds():
    """Within this context (on this thread), the C++ kernels of each graph Inductor compiles
    are built a few files at a time. Installs the patch on first use; nests; yields nothing.
    Does nothing where the accelerator `batched_kernel_builds` is off."""
    if not enabled("batched_kernel_builds"):
        yield
        return
    _install()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def run_batched(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` inside `batched_builds()`: for a call of a compiled function that
    may compile (a first call, or one with its guards checked)."""
    with batched_builds():
        return fn(*args, **kwargs)


def _install() -> None:
    global _original
    with _lock:
        if _original is not None:
            return
        from torch._inductor.async_compile import AsyncCompile
        _original = AsyncCompile.cpp_pybinding
        AsyncCompile.cpp_pybinding = _cpp_pybinding


def _cpp_pybinding(self, argtypes, source_code):
    """`AsyncCompile.cpp_pybinding` while patched: a kernel deferred to its module's batch."""
    from torch._inductor.async_compile import get_compile_threads, kernel_code_log
    if (getattr(_local, "depth", 0) == 0 or get_compile_threads() <= 1
            or len(_ENTRY.findall(source_code)) != 1 or len(_NAME.findall(source_code)) != 1):
        return _original(self, argtypes, source_code)
    kernel_code_log.info("CPP+Bindings Kernel:\n%s", source_code)  # as Inductor logs it
    batch = self.__dict__.get("_shram_batch")
    if batch is None or batch.started:  # one batch per wrapper module (its AsyncCompile)
        batch = self.__dict__["_shram_batch"] = _Batch(self)
    return batch.add(list(argtypes), source_code)


@functools.cache
def _future_type():
    # WHY made on first use: the package imports this module, and importing Inductor's
    # codecache at that point would add its import time to every command.
    from torch._inductor.codecache import CodeCacheFuture

    class KernelFuture(CodeCacheFuture):
        """One kernel of a batch; `AsyncCompile.wait` resolves it like Inductor's own futures."""

        def __init__(self, batch, index: int):
            self.batch, self.index = batch, index

        def result(self, timeout=None):
            return self.batch.kernel(self.index)

    return KernelFuture


class _Batch:
    """The kernels of one wrapper module, built together on first use."""

    def __init__(self, owner):
        self.owner = owner  # the module's AsyncCompile
        self.items: list[tuple] = []  # (argtypes, source)
        self.kernels: list | None = None
        self.started = False

    def add(self, argtypes: list, source: str):
        self.items.append((argtypes, source))
        return _future_type()(self, len(self.items) - 1)

    def _inductors(self, i: int):
        """Kernel i built the way Inductor builds it (a future)."""
        return _original(self.owner, *self.items[i])

    def kernel(self, index: int):
        if self.kernels is None:
            self.started = True
            self.kernels = self._build()
        return self.kernels[index]

    def _build(self) -> list:
        from torch._inductor.async_compile import get_compile_threads
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        groups = split_by_size([len(s) for _, s in self.items], get_compile_threads())
        pending = []  # (group, module getter or None)
        for group in groups:
            source = combined_source([self.items[i][0] for i in group], [self.items[i][1] for i in group])
            get = None
            if source is not None and len(group) > 1:
                get = CppPythonBindingsCodeCache.load_async(source, "cpu", submit_fn=type(self.owner).submit)
            pending.append((group, get))
        # A kernel alone in its group is Inductor's build, submitted now beside the files.
        alone = {i: self._inductors(i) for group, get in pending if get is None for i in group}
        kernels: list = [None] * len(self.items)
        for group, get in pending:
            if get is None:
                continue
            try:
                module = get()
                for j, i in enumerate(group):
                    kernels[i] = getattr(module, f"kernel_{j}")
            except Exception as e:  # noqa: BLE001 (each kernel is then built as Inductor builds it)
                log.info("building %d kernels as one file failed (%s); building them one by one",
                         len(group), str(e).splitlines()[0] if str(e) else type(e).__name__)
                alone.update({i: self._inductors(i) for i in group})
        for i, f in alone.items():
            kernels[i] = f.result()
        return kernels


def split_by_size(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of `sizes` in at most `n` groups of about equal total (largest first, each to
    the lightest group), each group in its original order."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(n, len(sizes))))]
    totals = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = totals.index(min(totals))
        groups[g].append(i)
        totals[g] += sizes[i]
    return [sorted(g) for g in groups if g]


def combined_source(argtypes: list[list[str]], sources: list[str]) -> str | None:
    """One C++ file holding `sources` (each defining Inductor's entry `kernel`), the i-th entry
    renamed `kernel_<i>`, and a Python module `kernel` exposing each as `kernel_<i>`, from
    Inductor's own binding template. None where that template is not the one expected."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as C
    parts = [_ENTRY.sub(f"void kernel_{i}(", s, count=1) for i, s in enumerate(sources)]

    def suffix(name: str, types: list[str]) -> str:
        args = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(types))
        return C.suffix_template.format(arg_len=len(types), entry_func=name,
                                        call_entry_func=f"{name}({args}); Py_RETURN_NONE;",
                                        extra_parse_arg=C.extra_parse_arg.format(array_len=-1))

    methods, module = "static PyMethodDef py_methods[]", "static struct PyModuleDef py_module"
    head = module_part = None
    functions = []
    for i, types in enumerate(argtypes):
        s = suffix(f"kernel_{i}", types)
        start = s.find(f"static PyObject* kernel_{i}_py(")
        end = s.find(methods)
        if start < 0 or end < start or s.count(methods) != 1:
            return None
        head = head or s[:start]
        functions.append(s[start:end])
    s = suffix("kernel", [])
    if s.count(module) != 1 or C.entry_function != "kernel":
        return None
    module_part = s[s.find(module):]
    table = "".join(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},\n' for i in range(len(sources)))
    return ("\n".join(parts) + head + "".join(functions)
            + f"{methods} = {{\n{table}    {{NULL, NULL, 0, NULL}}}};\n\n" + module_part)
