"""Probe: 48 single-row cache writes per call (a bench-model decode step's count) as the
portable in-place `index_put_` the `.pte` runs against ExecuTorch's LLM custom op
`llama::update_cache_with_indices` (which needs 4-D (1, N, 1, u) buffers: on a view of a 2-D
buffer its functionalized form leaves an `as_strided` that has no out variant), both in the pip
runtime, no delegate (section 24).

Run: python export/probes/probe_update_cache.py
"""
import time, statistics, sys, torch
from torch import nn
import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers llama ops (AOT)
from executorch.exir import to_edge_transform_and_lower, EdgeCompileConfig, ExecutorchBackendConfig
from executorch.runtime import Runtime

N, u, W = 8272, 16, 48
class M(nn.Module):
    def __init__(self, custom):
        super().__init__()
        self.custom = custom
        for i in range(W):
            self.register_buffer(f"c{i}", torch.zeros(1, N, 1, u) if custom else torch.zeros(N, u))
    def forward(self, rows, vals):
        out = vals.sum()
        for i in range(W):
            c = getattr(self, f"c{i}")
            if self.custom:
                torch.ops.llama.update_cache_with_indices(vals.view(1, -1, 1, u), c, 0, rows.view(1, -1))
            else:
                c.index_put_((rows,), vals)
        return out + self.c0.view(N, u)[0, 0]
res = {}
rt = Runtime.get()
progs = {}
for custom in (False, True):
    m = M(custom).eval()
    args = (torch.tensor([5]), torch.randn(1, u))
    ep = torch.export.export(m, args, strict=False)
    et = to_edge_transform_and_lower(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False)).to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True))
    buf = et.buffer
    progs[custom] = (buf, rt.load_program(buf))
    meth = progs[custom][1].load_method("forward")
    out = meth.execute([torch.tensor([7]), torch.full((1, u), 2.0)])
    print("custom" if custom else "index_put_", "ok", out[0].item(), flush=True)
    res[custom] = meth
for r in range(3):
    for custom, meth in res.items():
        ts = []
        a = [torch.tensor([9]), torch.randn(1, u)]
        for _ in range(2000):
            t = time.perf_counter(); meth.execute(a); ts.append(time.perf_counter() - t)
        print("custom" if custom else "index_put_", round(statistics.median(ts) * 1e6, 1), "us per call of", W, "writes")
