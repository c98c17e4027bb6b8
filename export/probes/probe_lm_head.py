"""Probe: is the lm_head delegated to XNNPACK? `x @ W.t()` vs `F.linear(x, W)` (bench sizes).

Run: python export/probes/probe_lm_head.py
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime


class MatT(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x):
        return x @ self.w.t()


class Lin(MatT):
    def forward(self, x):
        return F.linear(x, self.w)


def main():
    torch.manual_seed(0)
    w = torch.randn(50277, 512) * 0.02
    x = torch.randn(1, 512)
    for cls in (MatT, Lin):
        m = cls(w).eval()
        with torch.no_grad():
            ep = torch.export.export(m, (x,), strict=True)
        et = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        plan = et.executorch_program.execution_plan[0]
        kernels = [plan.operators[i.instr_args.op_index].name for c in plan.chains for i in c.instructions
                   if type(i.instr_args).__name__ == "KernelCall"]
        meth = Runtime.get().load_program(et.buffer).load_method("forward")
        out = meth.execute([x])[0]
        for _ in range(3):
            meth.execute([x])
        t = time.perf_counter()
        for _ in range(20):
            meth.execute([x])
        ms = (time.perf_counter() - t) / 20 * 1e3
        print(f"{cls.__name__}: portable kernels {kernels}, {ms:.2f} ms/call, err {(out - m(x)).abs().max():.1e}")


if __name__ == "__main__":
    main()
