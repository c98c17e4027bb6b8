"""`benchmarks/kernel_loops.py` attributes perf samples to the loop nests of Inductor's
generated C++: its parser finds each top-level nest, in a kernel with and without an OpenMP
parallel region, with the nest's outer loop bounds."""

from helpers import load_benchmark

BODY = """\
{name}
{{
{open}{pad}{{
{pad}    #pragma GCC ivdep
{pad}    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(5L); x0+=static_cast<int64_t>(1L))
{pad}    {{
{pad}        for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(64L); x1+=static_cast<int64_t>(8L))
{pad}        {{
{pad}            out_ptr0[x1 + 64L*x0] = in_ptr0[x1];
{pad}        }}
{pad}    }}
{pad}}}
{pad}{{
{pad}    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(480L); x0+=static_cast<int64_t>(1L))
{pad}    {{
{pad}        out_ptr1[x0] = in_ptr1[x0];
{pad}    }}
{pad}}}
{close}}}
"""


def _tool():
    return load_benchmark("kernel_loops")


def test_loop_nests_of_a_kernel_with_and_without_openmp():
    nests = _tool().nests
    head = ['#include <torch/csrc/inductor/cpp_prefix.h>', 'extern "C"  void kernel(const float* in_ptr0)']
    plain = BODY.format(name="\n".join(head), open="", pad="    ", close="").splitlines()
    omp = BODY.format(name="\n".join(head), open="    #pragma omp parallel num_threads(2)\n    {\n",
                      pad="        ", close="    }\n").splitlines()
    for src in (plain, omp):
        got = nests(src)
        assert [h for _, _, h in got] == ["x0 < 5L, x1 < 64L", "x0 < 480L"], got
        (a0, b0, _), (a1, b1, _) = got
        assert "x0<static_cast<int64_t>(5L)" in src[a0 + 1] and src[b0 - 1].strip() == "}"
        assert "out_ptr1" in "\n".join(src[a1 - 1:b1]) and "out_ptr0" not in "\n".join(src[a1 - 1:b1])
