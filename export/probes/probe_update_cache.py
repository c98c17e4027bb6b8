"""Probe: 48 single-row cache writes per call (a bench-model decode step's count) as the
portable in-place `index_put_` the `.pte` runs against ExecuTorch's LLM custom op
`llama::update_cache_with_indices` (which needs 4-D (1, N, 1, u) buffers: on a view of a 2-D
buffer its functionalized form leaves an `as_strided` that has no out variant), both in the pip
runtime, no delegate (section 24).

Run: python export/probes/probe_update_cache.py
"""

import statistics
import time

import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers the llama ops (AOT)
import torch
from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.runtime import Runtime
from torch import nn

N, U, WRITES = 8272, 16, 48  # bench model: 16 experts x 517 cache rows, head width 16


class Writes(nn.Module):
    """WRITES buffers, one row written into each per call."""

    def __init__(self, custom: bool):
        super().__init__()
        self.custom = custom
        for i in range(WRITES):
            self.register_buffer(f"c{i}", torch.zeros(1, N, 1, U) if custom else torch.zeros(N, U))

    def forward(self, rows: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        for i in range(WRITES):
            c = getattr(self, f"c{i}")
            if self.custom:
                torch.ops.llama.update_cache_with_indices(vals.view(1, -1, 1, U), c, 0, rows.view(1, -1))
            else:
                c.index_put_((rows,), vals)
        return vals.sum() + self.c0.view(N, U)[0, 0]


def main() -> None:
    rt = Runtime.get()
    kept, methods = [], {}
    for custom in (False, True):
        ep = torch.export.export(Writes(custom).eval(), (torch.tensor([5]), torch.randn(1, U)), strict=False)
        # run_reinplace_pass: as the library's .pte; without it each write copies its buffer
        et = to_edge_transform_and_lower(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False)) \
            .to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True))
        buf = et.buffer
        prog = rt.load_program(buf)
        kept.append((buf, prog))  # load_program(bytes) does not keep the bytes alive (section 22)
        methods["update_cache_with_indices" if custom else "index_put_"] = prog.load_method("forward")
    args = [torch.tensor([9]), torch.randn(1, U)]
    for _ in range(3):
        for name, meth in methods.items():
            ts = []
            for _ in range(2000):
                t = time.perf_counter()
                meth.execute(args)
                ts.append(time.perf_counter() - t)
            print(f"{name}: {statistics.median(ts) * 1e6:.1f} us per call of {WRITES} writes")


if __name__ == "__main__":
    main()
