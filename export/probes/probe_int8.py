"""Probe 3: int8 linear layers for XNNPACK on executorch 1.4.1 + torchao 0.18.

Run: python export/probes/probe_int8.py
Compares fp32 / 8da8w (dynamic int8 activations, int8 per-channel weights) / 8w (weight-only)
[/ + 8-bit embedding] on a toy LM made of nn.Linear layers: lowering, delegate coverage, file
size, logits drift and latency through executorch.runtime.
"""

import copy
import os
import tempfile
import time

import torch
from torch import nn

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.runtime import Runtime


class ToyLM(nn.Module):
    def __init__(self, V=4096, d=512, F=1536, n=4):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(d, F, bias=False), "gate": nn.Linear(d, F, bias=False),
                           "down": nn.Linear(F, d, bias=False)}) for _ in range(n))
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for l in self.layers:
            x = x + l["down"](torch.nn.functional.silu(l["gate"](x)) * l["up"](x))
        return self.head(x)


def quantize(model, kind):
    """Apply a torchao config in place. WHY torchao quantize_ (not PT2E XNNPACKQuantizer): it is
    what executorch 1.4.1's own LLM export uses (extension/llm/export/quantize.py), and the
    XNNPACK partitioner pattern-matches its exported dq/q ops into QD8 GEMMs."""
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import (Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig,
                                                quantize_)
    if kind in ("8da8w", "8da8w+emb"):
        quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)))
    elif kind == "8w":
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)))
    if kind.endswith("+emb"):
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    return model


def lower(model, path, fuse=False):
    ex = (torch.randint(0, 4096, (1, 1)),)
    with torch.no_grad():
        ep = torch.export.export(model, ex, strict=True)
    et = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch(
        ExecutorchBackendConfig(do_quant_fusion_and_const_prop=fuse))
    with open(path, "wb") as f:
        f.write(et.buffer)
    plan = et.executorch_program.execution_plan[0]
    kernels = {}
    ndel = 0
    for ch in plan.chains:
        for ins in ch.instructions:
            a = ins.instr_args
            if type(a).__name__ == "KernelCall":
                k = plan.operators[a.op_index].name
                kernels[k] = kernels.get(k, 0) + 1
            elif type(a).__name__ == "DelegateCall":
                ndel += 1
    return ndel, kernels


def main():
    tmp = tempfile.mkdtemp()
    base = ToyLM().eval()
    x = torch.randint(0, 4096, (1, 1))
    with torch.no_grad():
        ref = base(x)
    rt = Runtime.get()
    sizes = {}
    for kind in ("fp32", "8da8w", "8w", "8da8w+emb", "8da8w+emb/fuse"):
        fuse = kind.endswith("/fuse")
        kind = kind.replace("/fuse", "")
        m = copy.deepcopy(base)
        try:
            if kind != "fp32":
                quantize(m, kind)
            with torch.no_grad():
                eager_q = m(x)
            path = os.path.join(tmp, f"{kind}.pte")
            ndel, kernels = lower(m, path, fuse)
            meth = rt.load_program(path).load_method("forward")
            out = meth.execute([x])[0]
            for _ in range(3):
                meth.execute([x])
            t0 = time.perf_counter()
            for _ in range(50):
                meth.execute([x])
            ms = (time.perf_counter() - t0) / 50 * 1e3
            sizes[kind] = os.path.getsize(path)
            rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
            print(f"{kind + ('/fuse' if fuse else ''):15s} size {sizes[kind] / 2**20:7.2f} MiB ({sizes[kind] / sizes['fp32']:.2f}x)  "
                  f"{ms:6.2f} ms/call  delegates {ndel}  kernels {kernels}  "
                  f"pte-vs-eager_q {rel(out, eager_q):.1e}  pte-vs-fp32 {rel(out, ref):.1e} "
                  f"argmax same {bool(out.argmax() == ref.argmax())}")
        except Exception as e:  # noqa: BLE001
            print(f"{kind}: FAILED {type(e).__name__}: {str(e)[:400]}")


if __name__ == "__main__":
    main()
