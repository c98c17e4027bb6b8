"""The `.pte` benchmarks' own programs (`benchmarks/pte_linears.py`, `benchmarks/pte_parts.py`):
each lowers what it says it times, so a figure they report means what docs/performance.md says.
"""

import collections
import contextlib

import pytest
import torch

from helpers import delegated_ops, program_ops, tiny_model

from shram_static.export.pte import lower_program

pytestmark = pytest.mark.heavy  # each lowers a program or five (10-15 s on 2 busy cores)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_linear_only_program_of_the_benchmark(quantize):
    """`benchmarks/pte_linears.py` lowers a program of the exported step's linear layers alone:
    every nn.Linear of the export copy (the fused experts included), quantized as `export_pte`
    quantizes, counted at their stored bytes, each output's mean as the module
    computes it; and its op chains run the ops they count. The int8 layers are counted, not
    lowered: lowering the same program of quantized linears is `export_pte`'s
    (tests/test_export_quantized.py)."""
    from executorch.runtime import Runtime

    from helpers import load_benchmark
    from shram_static.export.common import export_copy

    bench = load_benchmark("pte_linears")
    model = tiny_model(num_decoder_layers=1)
    linears, nbytes = bench.linear_layers(model, quantize)
    plain = [m for m in export_copy(model).modules() if isinstance(m, torch.nn.Linear)]
    assert [lin.weight.shape for lin in linears] == [lin.weight.shape for lin in plain]
    weights = sum(lin.weight.numel() for lin in plain)
    scales = sum(lin.out_features for lin in plain)  # one per output channel
    assert nbytes == (4 * weights if quantize is None else weights + scales * 4 + scales)  # int8 zero points
    if quantize is not None:
        return
    buf, xs = bench.lower_linears(linears)
    got = Runtime.get().load_program(buf).load_method("forward").execute(xs)[0]
    with torch.no_grad():
        want = bench.Linears(linears)(*xs)
    assert got.shape == (len(linears),)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for name, (method, _), x, ops in bench.op_chains(20):
        assert ops == 20, name
        assert method.execute(x)[0].shape == x[0].shape


def test_parts_benchmark_takes_out_each_part():
    """`benchmarks/pte_parts.py` exports the decode step with one part taken out: each variant's
    program lacks what that part runs (so a patch that stopped applying cannot report a part as
    free)."""
    from helpers import load_benchmark

    bench = load_benchmark("pte_parts")
    model = tiny_model(num_decoder_layers=1)

    def ops(part):
        with bench.PARTS[part]() if part else contextlib.nullcontext():
            et = lower_program(model, prefill_chunk=None, parallel=False)
        delegated = collections.Counter(name for name, _ in delegated_ops(et, "forward"))
        return program_ops(et, "forward")["kernels"], delegated

    kernels, delegated = ops(None)
    assert "aten::index_select.out" in kernels and "aten::topk.values" in kernels
    assert delegated["sqrt"] > 0 and delegated["_softmax"] == 2  # entmax; both attentions
    k, d = ops("attention")
    assert d["_softmax"] == 0 and d["bmm"] < delegated["bmm"] and "aten::index_select.out" not in k
    k, d = ops("gathers")
    assert "aten::index_select.out" not in k and d["_softmax"] == 2
    k, d = ops("routing")
    assert "aten::topk.values" not in k and d["sqrt"] == 0
    k, d = ops("entmax")
    assert "aten::topk.values" in k and d["sqrt"] == 0 and d["_softmax"] == 3
