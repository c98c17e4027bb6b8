"""The C++ kernels of one Inductor wrapper module are built as a few files inside
`batched_builds()`, run as built one by one, and fall back to Inductor's own builds
(shram_static/accelerators/kernel_builds.py)."""

import contextlib

import pytest
import torch
from torch._inductor import config
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.codecache import CppPythonBindingsCodeCache

from shram_static.accelerators import enabled, kernel_builds
from shram_static.accelerators.kernel_builds import batched_builds, combined_source, split_by_size

# Kernels as Inductor's Python wrapper asks for them: C++ defining the entry `kernel`, with the
# argument types of its bindings. Each also defines a file-scope helper, as some of Inductor's
# do; SAME_HELPER gives two kernels one helper name, so they cannot share one file.
def scale(helper="helper_scale", op="x * s"):
    """A kernel out = op(in, s) elementwise, through a file-scope helper named `helper`."""
    return (["const float*", "float*", "float", "int64_t"], f"""
#include <cstdint>
static float {helper}(float x, float s) {{ return {op}; }}
extern "C" void kernel(const float* in_ptr0, float* out_ptr0, float s, int64_t n) {{
    for (int64_t i = 0; i < n; i++) out_ptr0[i] = {helper}(in_ptr0[i], s);
}}
""")


SCALE = scale()
CUMSUM = (["const int64_t*", "int64_t*", "int64_t"], """
#include <cstdint>
static int64_t helper_add(int64_t a, int64_t b) { return a + b; }
extern "C"  void  kernel(const int64_t* in_ptr0,
                       int64_t* out_ptr0, int64_t n) {
    int64_t acc = 0;
    for (int64_t i = 0; i < n; i++) { acc = helper_add(acc, in_ptr0[i]); out_ptr0[i] = acc; }
}
""")
SAME_HELPER = scale(op="x + s")
BIG = (CUMSUM[0], CUMSUM[1] + "// padding\n" * 40)  # longer than any two others


def run_scale(fn, add=False):
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty(8)
    fn(x, y, 3.0, 8)
    torch.testing.assert_close(y, x + 3 if add else x * 3, rtol=0, atol=0)


def run_cumsum(fn):
    x = torch.tensor([3, -1, 4, 1, -5], dtype=torch.int64)
    y = torch.empty_like(x)
    fn(x, y, 5)
    assert torch.equal(y, x.cumsum(0))


def module_load(kernels: list[tuple], batched=True):
    """What a generated wrapper module does: one `cpp_pybinding` per kernel, then `wait`."""
    ac = AsyncCompile()
    scope = {}
    with batched_builds() if batched else contextlib.nullcontext():
        for i, (types, src) in enumerate(kernels):
            scope[f"k{i}"] = ac.cpp_pybinding(types, src)
        ac.wait(scope)
    return [scope[f"k{i}"] for i in range(len(kernels))]


@pytest.fixture
def accelerated():
    """The tests of `batched_builds` need the accelerator on (this torch, no SHRAM_STATIC_STOCK)."""
    if not enabled("batched_kernel_builds"):
        pytest.skip("the accelerator batched_kernel_builds is off here (torch version or SHRAM_STATIC_STOCK)")


@pytest.fixture
def threads(accelerated):
    """Inductor's compile threads, set per test through Inductor's own `config.patch` (a
    monkeypatched config entry is lost on undo under pytest 9.2)."""
    with contextlib.ExitStack() as stack:
        yield lambda n: stack.enter_context(config.patch(compile_threads=n))


@pytest.fixture
def files(monkeypatch):
    """The C++ files built through Inductor's cache during a test: their kernel counts."""
    built = []
    orig = CppPythonBindingsCodeCache.load_async.__func__

    def spy(cls, main_code, *a, **k):
        built.append(main_code.count("PyObject* kernel"))
        return orig(cls, main_code, *a, **k)
    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_async", classmethod(spy))
    return built


def test_kernels_of_one_module_build_as_one_file_per_thread_and_run(threads, files):
    threads(2)
    kernels = module_load([SCALE, BIG, scale("helper_negated", "-x * s")])
    assert sorted(files) == [1, 2]  # 3 kernels, 2 threads: BIG alone, the other two in one file
    run_scale(kernels[0])
    run_cumsum(kernels[1])
    assert kernels[0].__name__ == "kernel_0" and kernels[2].__name__ == "kernel_1"
    x, y = torch.ones(4), torch.empty(4)
    kernels[2](x, y, 2.0, 4)
    assert torch.equal(y, torch.full((4,), -2.0))
    assert len({id(k.__self__) for k in kernels}) == 2  # two libraries


def test_a_file_that_fails_to_build_falls_back_to_inductors_builds(threads, files):
    threads(2)
    kernels = module_load([SCALE, SAME_HELPER, BIG])
    # BIG alone; SCALE + SAME_HELPER in one file fails (one helper defined twice), so each
    # is then built alone
    assert sorted(files) == [1, 1, 1, 2]
    assert [k.__name__ for k in kernels] == ["kernel"] * 3
    run_scale(kernels[0])
    run_scale(kernels[1], add=True)
    run_cumsum(kernels[2])


def test_outside_the_context_or_with_one_thread_inductor_builds_each(threads, files):
    threads(2)
    kernels = module_load([SCALE, CUMSUM], batched=False)
    assert files == [1, 1]
    threads(1)
    files.clear()
    kernels += module_load([SCALE, CUMSUM])
    assert files == [1, 1]
    for k in kernels:
        assert k.__name__ == "kernel"  # Inductor's own binding
    run_scale(kernels[2])
    run_cumsum(kernels[3])


def test_a_source_naming_kernel_elsewhere_is_built_alone(threads, files):
    threads(2)
    odd = (SCALE[0], SCALE[1] + "// the kernel above\n")
    kernels = module_load([odd, BIG, SCALE, scale("helper_other")])
    assert sorted(files) == [1, 1, 2]  # `odd` by Inductor, BIG alone, the other two in one file
    assert [k.__name__ for k in kernels] == ["kernel", "kernel", "kernel_0", "kernel_1"]
    run_scale(kernels[0])
    run_cumsum(kernels[1])
    run_scale(kernels[2])
    run_scale(kernels[3])


def test_nested_contexts_and_exceptions_restore_the_state(accelerated):
    with batched_builds():
        with batched_builds():
            pass
        assert kernel_builds._depth == 1
    with pytest.raises(ValueError):
        with batched_builds():
            raise ValueError
    assert kernel_builds._depth == 0


def test_split_by_size_balances_and_keeps_order():
    assert split_by_size([5, 1, 1, 3], 2) == [[0], [1, 2, 3]]
    assert split_by_size([1, 1], 4) == [[0], [1]]
    assert split_by_size([2, 2, 2, 2], 2) == [[0, 2], [1, 3]]
    assert split_by_size([7], 1) == [[0]]


def test_combined_source_renames_each_entry_and_binds_it():
    src = combined_source([SCALE[0], CUMSUM[0]], [SCALE[1], CUMSUM[1]])
    assert "void kernel_0(const float*" in src and "void kernel_1(const int64_t*" in src
    # one row each in the method table, in the calling convention of this torch's template
    assert all(src.count(f'"kernel_{i}",') == 1 and src.count(f"kernel_{i}_py") == 2 for i in (0, 1))
    assert "PyInit_kernel(void)" in src and src.count("static PyMethodDef py_methods[]") == 1
    assert "requires 4 args" in src and "requires 3 args" in src


def test_after_hook_compiles_a_dynamo_compile_builds_in_batches_and_calls_go_straight(threads, files):
    """`hook_compiles()` (what `accelerators.prepare_compile` installs when a compiled step is
    built) batches the kernels of every later compile with no context around the call, and
    leaves the batching off between compiles."""
    from torch._dynamo.callback import callback_handler

    threads(2)
    assert kernel_builds.hook_compiles()
    torch._dynamo.reset()  # clears Dynamo's callbacks: registered again
    assert kernel_builds.hook_compiles() and kernel_builds.hook_compiles()
    assert len(callback_handler.start_callbacks) == len(set(callback_handler.start_callbacks)) >= 1

    def fn(x):  # a scan, a reduction and a sort: kernels Inductor does not fuse
        a = x.sin().cumsum(0) * 3
        b = (a - a.amax(0)).exp().cumsum(1)
        return a, b, torch.sort(b + x.cos(), dim=0).values * b.sum()
    x = torch.randn(6, 5)
    out = torch.compile(fn, fullgraph=True)(x)
    for got, want in zip(out, fn(x)):
        torch.testing.assert_close(got, want)
    assert files and max(files) >= 2  # kernels of one module shared a file
    assert kernel_builds._depth == 0  # off again once the compile ended
