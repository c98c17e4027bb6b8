"""The integer dot-product ops (`shram_static.int_kernels`, csrc/int_linear.cpp) against a slow,
obviously correct torch reference of the same quantized arithmetic, on every path this CPU
runs; the layers' compiled step (fullgraph, no recompiles); the float path where the build fails.
"""

import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from shram_static import int_kernels
from shram_static.quantized import Int4Linear, Int8Linear

if int_kernels.load() is None:  # WHY: a machine without a compiler runs the float path only
    pytest.skip("the integer kernels are not built here", allow_module_level=True)
PATHS = [c for c in int_kernels.ISAS.values() if c <= int_kernels.best_isa()]


def reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Row by row, block by block: x quantized per block of 32 (scale amax / 127, round half to
    even), the block's integer dot products with q, then acc + isum * (s_w * s_x) in float32."""
    n, K = x.shape
    N, G = s.shape
    y = torch.zeros(n, N)
    for r in range(n):
        for g in range(G):
            xb = x[r, 32 * g:32 * g + 32]
            d = xb.abs().max() / 127
            inv = 1 / d if d != 0 else torch.tensor(0.0)
            xq = torch.round(xb * inv).clamp(-127, 127).to(torch.int64)
            isum = (q[:, 32 * g:32 * g + len(xb)].to(torch.int64) * xq).sum(1)  # (N,) exact
            y[r] = y[r] + isum.float() * (s[:, g].float() * d)
    return y


def random_weight(N: int, K: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lim = 8 if bits == 4 else 127
    q = torch.randint(-lim, lim if bits == 4 else lim + 1, (N, K), generator=g)
    q[q == 0] = 1  # nonzero weights
    s = (torch.rand(N, -(-K // 32), generator=g) * 0.02 + 0.001).half()
    return q, s


@pytest.mark.parametrize("bits", [4, 8])
def test_op_matches_reference_on_every_path(bits):
    """Odd sizes (no multiple of the output block or the input block), rows 1..9 and 13, inputs
    with a zero block and an outlier; every path exactly the reference's float sequence."""
    for N, K, seed in ((37, 45, 0), (16, 64, 1), (5, 100, 2), (50, 33, 3)):
        q, s = random_weight(N, K, bits, seed)
        packed, scale = int_kernels.pack(q, s, bits)
        for n in (1, 2, 3, 4, 5, 8, 9, 13):
            x = torch.randn(n, K, generator=torch.Generator().manual_seed(seed + n))
            x[0, :32] = 0 if n > 1 else x[0, :32]  # a block of zeros: scale 0
            x[-1, -1] = 40.0  # an outlier in the last (partial) block
            want = reference(x, q, s)
            for isa in PATHS:
                got = int_kernels.int_linear(x, packed, scale, N, bits, isa)
                assert torch.equal(got, want), (N, K, n, isa, (got - want).abs().max())


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips(bits):
    q, s = random_weight(21, 70, bits, 5)
    packed, scale = int_kernels.pack(q, s, bits)
    uq, us = int_kernels.unpack(packed, scale, bits)
    assert torch.equal(uq[:21, :70], q.to(torch.int32)) and torch.equal(us[:21], s.float())
    assert not uq[21:].any() and not uq[:, 70:].any() and not us[21:].any()


def test_op_leading_dims_and_errors():
    q, s = random_weight(20, 40, 4, 6)
    packed, scale = int_kernels.pack(q, s, 4)
    x = torch.randn(2, 3, 40)
    y = int_kernels.int_linear(x, packed, scale, 20, 4)
    assert y.shape == (2, 3, 20) and torch.equal(y.view(6, 20), reference(x.view(6, 40), q, s))
    op = torch.ops.shram_static.int4_linear
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), packed, scale, 20)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(torch.randn(1, 72), packed, scale, 20)
    with pytest.raises(RuntimeError, match="not available"):
        op(x, packed, scale, 20, 9)
    with pytest.raises(RuntimeError, match="chunk shape"):
        torch.ops.shram_static.int8_linear(x, packed, scale, 20)


def test_env_values():
    assert int_kernels.parse_isa(None) == 0 and int_kernels.parse_isa("AVX2") == 2
    assert int_kernels.parse_isa("off") is None
    with pytest.raises(ValueError, match=int_kernels.ENV):
        int_kernels.parse_isa("sse9")


def test_compiled_layers_fullgraph_no_recompile():
    """An int4 and an int8 layer in a compiled function (fullgraph: no graph break): the eager
    op's results, each row count compiled once, no recompile on new values."""
    torch.manual_seed(0)
    a, b = Int4Linear(torch.randn(40, 70)), Int8Linear(torch.randn(70, 40))

    def f(x):
        return b(torch.relu(a(x)))

    step = torch.compile(f, fullgraph=True, dynamic=False)
    for n in (1, 5):
        step(torch.randn(n, 70))
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (1, 5):
            x = torch.randn(n, 70)
            assert torch.equal(step(x), f(x))


@pytest.mark.skipif(not (sys.platform.startswith("linux") and torch.backends.openmp.is_available()
                         and shutil.which("nm")), reason="reads the loaded library's OpenMP calls on Linux")
def test_ops_split_their_work_over_torch_threads():
    """at::parallel_for is an OpenMP pragma in ATen's headers: built without the compiler's OpenMP
    flag, the ops give the same results on one thread only."""
    libs = {line.split()[-1] for line in open("/proc/self/maps") if "shram_static_int_kernels" in line}
    assert len(libs) == 1, libs
    calls = subprocess.run(["nm", "-D", "--undefined-only", libs.pop()], capture_output=True, text=True,
                           check=True).stdout.split()
    assert "GOMP_parallel" in calls


def test_failed_build_warns_and_layers_take_float_path(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    with pytest.warns(RuntimeWarning, match="could not be built.*c\\+\\+: not found"):
        assert int_kernels.build(no_compiler) is False
    layer = Int4Linear(torch.randn(24, 64))
    monkeypatch.setattr(int_kernels, "ISA", None)
    x = torch.randn(3, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.allclose(layer(x), F.linear(x, layer.dequantized()), atol=1e-5)
