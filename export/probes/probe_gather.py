"""Probe: cost of gathering per-expert weights (`W[idx]`, portable aten::index.Tensor) in an
ExecuTorch program, as the sparse path does for each prefill chunk (bench sizes: L=16, d=512,
u=16, K=4, C=32), versus eager torch.

Run: python export/probes/probe_gather.py
"""

import time

import torch
from torch import nn

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 512, 16))

    def forward(self, h, idx):
        return torch.einsum("bcd,bckdu->bcku", h, self.w[idx])


class OneHot(Gather):
    """Same result without a gather: all L experts computed, then the K picked by a one-hot bmm."""

    def forward(self, h, idx):
        y = torch.einsum("bcd,ldu->bclu", h, self.w)                           # (B, C, L, u)
        oh = (idx[..., None] == torch.arange(16)).to(h.dtype)                  # (B, C, K, L)
        return oh @ y                                                          # (B, C, K, u)


class IndexSelect(Gather):
    """Same gather as rows of a flattened (L, d*u) weight: index_select copies whole rows."""

    def forward(self, h, idx):
        B, C, K = idx.shape
        w = self.w.view(16, 512 * 16).index_select(0, idx.reshape(-1)).view(B, C, K, 512, 16)
        return torch.einsum("bcd,bckdu->bcku", h, w)


def main():
    for C in (1, 32):
        h = torch.randn(1, C, 512)
        idx = torch.randint(0, 16, (1, C, 4))
        for cls in (Gather, IndexSelect, OneHot):
            m = cls().eval()
            with torch.no_grad():
                ref = m(h, idx)
                ep = torch.export.export(m, (h, idx), strict=True)
            et = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
            plan = et.executorch_program.execution_plan[0]
            kernels = [plan.operators[i.instr_args.op_index].name for c in plan.chains for i in c.instructions
                       if type(i.instr_args).__name__ == "KernelCall"]
            meth = Runtime.get().load_program(et.buffer).load_method("forward")
            out = meth.execute([h, idx])[0]
            for _ in range(3):
                meth.execute([h, idx])
            t = time.perf_counter()
            for _ in range(20):
                meth.execute([h, idx])
            ms = (time.perf_counter() - t) / 20 * 1e3
            t = time.perf_counter()
            with torch.no_grad():
                for _ in range(20):
                    m(h, idx)
            ems = (time.perf_counter() - t) / 20 * 1e3
            print(f"C={C} {cls.__name__}: ET {ms:.2f} ms/call (eager {ems:.2f}), portable {kernels}, "
                  f"err {(out - ref).abs().max():.1e}")


if __name__ == "__main__":
    main()
