"""Probe: the bench-config .pte with lm_head and router as F.linear (monkeypatched here) instead
of `x @ W.t()`, to measure what delegating them to XNNPACK buys (fp32 and int8).

Run: python export/probes/probe_flinear_bench.py /tmp/bench_flinear
"""

import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import shram_static.step as step_mod
from shram_static.entmax import entmax12
from shram_static.model import ShramForCausalLM
from shram_static.routing import block_select


def logits_linear(self, x):
    return F.linear(self.model.norm(x), self.output_weight)


def route_linear(h, routing_weight, live, start, taken, k):
    z = F.linear(h, routing_weight).float()
    scores = entmax12(z)
    idx, taken_out = block_select(z, live, start, taken, k)
    ps = scores.gather(-1, idx)
    P = ps / ps.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return idx, P.to(h.dtype), taken_out


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_flinear"
    os.makedirs(out, exist_ok=True)
    ShramForCausalLM.logits = logits_linear
    step_mod.route = route_linear
    from shram_static.bench import build_model
    from shram_static.export import export_pte
    model = build_model("bench")
    meta = {}
    for q in (None, "int8"):
        name = "int8" if q else "pte"
        t = time.perf_counter()
        path = export_pte(model, f"{out}/bench.{name}.pte", batch_size=1, prefill_chunk=32, quantize=q)
        meta[name] = dict(path=path, export_s=round(time.perf_counter() - t, 1),
                          file_mib=round(os.path.getsize(path) / 2**20, 1))
        print(name, meta[name], flush=True)
    json.dump(meta, open(f"{out}/bench.export.json", "w"))
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, f"{here}/bench_export.py", "--model", "bench", "--out", out,
                    "--formats", "pte,int8", "--skip-export"], check=True)


if __name__ == "__main__":
    main()
