"""Probe: what XNNPACK's f32 fully-connected costs at 1 and 4 rows for the same weights.

A `.pte` of 40 bench-model MLP projections (1366 x 512, 112 MB: past every cache), each
`F.linear(x, W)` on x (M, 512), lowered to XNNPACK; at 4 rows also as `mm(W, x.T).T` (W as
the left operand, never packed). The programs run alternately, 20-call medians per round.

Run: python export/probes/probe_xnnpack_rows.py [ROUNDS]
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime

N, D, OUT = 40, 512, 1366


class Projections(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.ParameterList([nn.Parameter(torch.randn(OUT, D) * 0.02) for _ in range(N)])
        self.form = form

    def forward(self, x):  # x (M, D)
        acc = 0
        for w in self.w:
            y = F.linear(x, w) if self.form == "linear" else torch.mm(w, x.t()).t()  # (M, OUT)
            acc = acc + y[:, :8].sum()  # every projection is used, the outputs stay small
        return acc.reshape(1)


def main(rounds: int) -> None:
    rt = Runtime.get()
    methods, buffers = {}, []
    for form, M in (("linear", 1), ("linear", 4), ("mm(W, x.T)", 4)):
        with torch.no_grad():
            ep = torch.export.export(Projections(form).eval(), (torch.randn(M, D),))
            buf = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
        buffers.append(buf)  # the program reads this memory, unowned: freed, it crashes (executorch#10725)
        methods[(form, M)] = (rt.load_program(buf).load_method("forward"), torch.randn(M, D))
    res = {k: [] for k in methods}
    for _ in range(rounds):
        for k, (m, x) in methods.items():
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                m.execute([x])
                ts.append(time.perf_counter() - t)
            res[k].append(1e3 * statistics.median(ts))
        print("  ".join(f"{f} M={M}: {v[-1]:.2f} ms" for (f, M), v in res.items()), flush=True)
    print(f"{N * OUT * D * 4 / 1e6:.0f} MB of weights; medians:",
          {f"{f} M={M}": round(statistics.median(v), 2) for (f, M), v in res.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
