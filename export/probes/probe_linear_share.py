"""How much of a bench-config decode step the nn.Linear layers alone cost in a .pte, fp32 vs
int8: explains why int8 speeds the whole step up less than it speeds the linears up.

Lowers ONE program holding exactly the bench model's nn.Linear layers (12 x [q,k,v,o of the
local path, gate, up, down, router] + lm_head), each applied to one token, with the same
XNNPACK partitioner and int8 flow as `export_pte`, and times a call.

Run:  python export/probes/probe_linear_share.py
"""

import time

import torch
from torch import nn


class Linears(nn.Module):
    def __init__(self, linears):
        super().__init__()
        self.linears = nn.ModuleList(linears)

    def forward(self, x512, x256, x1366):
        xs = {512: x512, 256: x256, 1366: x1366}
        return tuple(m(xs[m.in_features]) for m in self.linears)


def lower(m, args):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    with torch.no_grad():
        ep = torch.export.export(m, args, strict=True)
    return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer


def main():
    from executorch.runtime import Runtime
    from shram_static.bench import build_model
    from shram_static.export.pte import quantize_int8

    model = build_model("bench")
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for m in lin:
        m.in_features = m.weight.shape[1]
    mod = Linears(lin).eval()
    mb = sum(m.weight.numel() for m in lin) * 4 / 1e6
    args = tuple(torch.randn(1, 1, n) for n in (512, 256, 1366))
    assert {m.in_features for m in lin} <= {512, 256, 1366}
    print(f"{len(lin)} linears, {mb:.1f} MB fp32")
    for name, m in (("fp32", mod), ("int8", quantize_int8(mod))):
        t = time.perf_counter()
        buf = lower(m, args)
        prog = Runtime.get().load_program(buf)
        meth = prog.load_method("forward")
        for _ in range(5):
            meth.execute(list(args))
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            meth.execute(list(args))
            times.append(time.perf_counter() - t0)
        times.sort()
        med = times[len(times) // 2]
        print(f"{name}: {1e3 * med:.2f} ms per call (lowered in {time.perf_counter() - t:.0f} s, "
              f"{len(buf) / 2**20:.0f} MiB)", flush=True)


if __name__ == "__main__":
    main()
