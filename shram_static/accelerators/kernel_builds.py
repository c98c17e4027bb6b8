"""The C++ kernels of one compiled step built as a few files, not one file each.

WHY: Inductor builds each C++ kernel as its own library (`AsyncCompile.cpp_pybinding`: one g++ run
each, its fixed cost mostly instantiating `cpp_prefix.h`'s templates). Within `batched_builds()`
(entered for every Dynamo compile by `hook_compiles()`), a wrapper module's kernels are built when
first needed as `compile_threads` files of about equal size through Inductor's
`CppPythonBindingsCodeCache` (same flags, same cache); a kernel that resists the renaming to
`kernel_<i>`, or a file that fails to build, is built as Inductor builds it.
"""

import contextlib
import functools
import logging
import re
import threading

from .registry import enabled

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"\bvoid\s+kernel\s*\(")  # the definition of Inductor's entry function
_NAME = re.compile(r"\bkernel\b")
_lock = threading.Lock()
_original = None  # Inductor's AsyncCompile.cpp_pybinding, once patched
_depth = 0  # nesting of batched_builds() (process-wide: Dynamo's end callback may run on another thread)
_hook = None  # (start, end): the Dynamo callbacks of hook_compiles(), once made


@contextlib.contextmanager
def batched_builds():
    """Within the block, each compiled graph's C++ kernels are built a few files at a time (where
    `batched_kernel_builds` is on). Installs the patch on first use; nests."""
    global _depth
    if not enabled("batched_kernel_builds"):
        yield
        return
    _install()
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def hook_compiles() -> bool:
    """Enters `batched_builds()` for every Dynamo compile here (its start/end callbacks, registered again
    after `torch._dynamo.reset()`); returns whether they are in place. WHY Dynamo's private callbacks: a
    compile starts in whatever call first needs it; wrapping every call would put this on the token path."""
    global _hook
    if not enabled("batched_kernel_builds"):
        return False
    try:
        from torch._dynamo.callback import callback_handler as handler
        registered = handler.start_callbacks
    except (ImportError, AttributeError):  # another torch: its compiles build as Inductor does
        return False
    with _lock:
        if _hook is None:
            stack = contextlib.ExitStack()  # Dynamo runs start/end for the outermost compile only
            _hook = (lambda _args: stack.enter_context(batched_builds()),  # noqa: E731
                     lambda _args: stack.close())
        if _hook[0] not in registered:
            handler.register_start_callback(_hook[0])
            handler.register_end_callback(_hook[1])
    return True


def _install() -> None:
    global _original
    with _lock:
        if _original is None:
            from torch._inductor.async_compile import AsyncCompile
            _original = AsyncCompile.cpp_pybinding
            AsyncCompile.cpp_pybinding = _cpp_pybinding


def _cpp_pybinding(self, argtypes, source_code):
    """`AsyncCompile.cpp_pybinding` while patched: a kernel deferred to its module's batch."""
    from torch._inductor.async_compile import get_compile_threads, kernel_code_log
    if (_depth == 0 or get_compile_threads() <= 1
            or len(_ENTRY.findall(source_code)) != 1 or len(_NAME.findall(source_code)) != 1):
        return _original(self, argtypes, source_code)
    kernel_code_log.info("CPP+Bindings Kernel:\n%s", source_code)  # as Inductor logs it
    batch = self.__dict__.get("_shram_batch")
    if batch is None or batch.started:  # one batch per wrapper module (its AsyncCompile)
        batch = self.__dict__["_shram_batch"] = _Batch(self)
    return batch.add(list(argtypes), source_code)


@functools.cache
def _future_type():  # WHY on first use: importing Inductor's codecache costs every command
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

    def _inductors(self, i: int):  # kernel i built as Inductor builds it (a future)
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
    """One C++ file of `sources` (each defining Inductor's entry `kernel`, the i-th renamed `kernel_<i>`)
    and a Python module `kernel` exposing each, from Inductor's binding template (None if unexpected)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as C
    parts = [_ENTRY.sub(f"void kernel_{i}(", s, count=1) for i, s in enumerate(sources)]

    def suffix(name: str, types: list[str]) -> str:
        args = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(types))
        return C.suffix_template.format(arg_len=len(types), entry_func=name,
                                        call_entry_func=f"{name}({args}); Py_RETURN_NONE;",
                                        extra_parse_arg=C.extra_parse_arg.format(array_len=-1))

    methods, module = "static PyMethodDef py_methods[]", "static struct PyModuleDef py_module"
    last = "{NULL, NULL, 0, NULL}"  # the method table's closing row
    head, functions, rows = None, [], []
    for i, types in enumerate(argtypes):
        s = suffix(f"kernel_{i}", types)
        start = s.find(f"static PyObject* kernel_{i}_py(")
        end = s.find(methods)
        if start < 0 or end < start or s.count(methods) != 1 or s.find(last, end) < 0:
            return None
        head = head or s[:start]
        functions.append(s[start:end])
        # WHY the template's own row: its calling convention differs between releases (METH_FASTCALL from 2.15)
        rows.append(s[s.find("{", end) + 1:s.find(last, end)])
        if f'"kernel_{i}"' not in rows[-1]:
            return None
    s = suffix("kernel", [])
    if s.count(module) != 1 or C.entry_function != "kernel":
        return None
    module_part = s[s.find(module):]
    return ("\n".join(parts) + head + "".join(functions)
            + f"{methods} = {{" + "".join(rows) + f"{last}}};\n\n" + module_part)
