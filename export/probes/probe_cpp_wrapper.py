"""The compiled decode step with Inductor's C++ wrapper instead of its Python wrapper (not kept).

torch 2.13's `CppWrapperCpu.codegen_invoke_subgraph` raises NotImplementedError, so the nested
layer region (step.py) cannot use the C++ wrapper. This probe fills it in the way pytorch PR
#194703 describes for a later torch: each call's region inlined into its own C++ block, its
outputs declared outside the block; on top of that, the int-array declarations Inductor caches
per graph are dropped at each block's edges and the region's buffers are forgotten between
calls, so every inlined copy declares its own. It prints the decode step's cold compile time,
the largest |difference| from an eager decoder, and the median decode step.

Run:  TORCHINDUCTOR_CACHE_DIR=<fresh dir> python export/probes/probe_cpp_wrapper.py --model bench --mode cpp
      (then --mode py for the Python wrapper, same cache dir: its prefill is already built)
"""

import argparse
import dataclasses
import statistics
import time

import torch
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.codegen.wrapper import EnterSubgraphLine, ExitSubgraphLine, WrapperLine
from torch.utils._ordered_set import OrderedSet

from shram_static.bench import build_model
from shram_static.decoder import NO_SIZE_ASSERTS, StaticDecoder


@dataclasses.dataclass
class ForgetIntArrays(WrapperLine):
    """At a block's edge: int arrays declared inside a block are not visible after it."""
    wrapper: object

    def codegen(self, code):
        self.wrapper.codegen_int_array_var_cache.clear()


def codegen_invoke_subgraph(self, invoke_subgraph):
    outer_inputs = [buf.codegen_reference() for buf in invoke_subgraph.inputs]
    outer_outputs = []
    for out in invoke_subgraph.outputs:
        self.writeline(f"RAIIAtenTensorHandle {out.get_name()};")
        outer_outputs.append(out.get_name())
    g = invoke_subgraph.subgraph.graph
    self.writeline(ForgetIntArrays(self))
    self.writeline("{")
    self.writeline(EnterSubgraphLine(self, g))
    self.codegen_subgraph(invoke_subgraph.subgraph, outer_inputs, outer_outputs)
    self.writeline(ExitSubgraphLine(self))
    self.writeline("}")
    self.writeline(ForgetIntArrays(self))
    inner = g.name + "_"  # the region's buffers: allocated again by the next inlined call
    self.allocated = OrderedSet(n for n in self.allocated if not n.startswith(inner))
    self.freed = OrderedSet(n for n in self.freed if not n.startswith(inner))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bench")
    p.add_argument("--mode", choices=["cpp", "py"], default="cpp")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    CppWrapperCpu.codegen_invoke_subgraph = codegen_invoke_subgraph
    m = build_model(a.model).eval()
    d = StaticDecoder(m, batch_size=1, prefill_chunk=32, compile=True)
    e = StaticDecoder(m, batch_size=1, prefill_chunk=32)
    if a.mode == "cpp":
        d.decode_step = torch.compile(d._decode_step, fullgraph=True, dynamic=False,
                                      options={**NO_SIZE_ASSERTS, "cpp_wrapper": True})
    ids = torch.randint(0, m.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    d.prefill(ids)
    e.prefill(ids)
    x = torch.tensor([5])
    t = time.perf_counter()
    got = d.decode(x)
    print(f"{a.mode}: decode step compiled in {time.perf_counter() - t:.1f} s")
    diff = (got - e.decode(x)).abs().max().item()
    for _ in range(5):
        diff = max(diff, (d.decode(x) - e.decode(x)).abs().max().item())
    ts = []
    for _ in range(a.rounds * 40):
        t = time.perf_counter()
        d.decode(x)
        ts.append(time.perf_counter() - t)
    print(f"{a.mode}: max |diff| from eager {diff:.2e}, decode median {1000 * statistics.median(ts):.2f} ms")


if __name__ == "__main__":
    main()
