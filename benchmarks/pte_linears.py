"""How much of a `.pte` decode step its linear layers alone take in ExecuTorch (XNNPACK).

Builds a program of nothing but the decode step's linear layers as the exported step holds
them (`export_copy`: the experts fused, every expert in one linear each way; with `--quantize`,
quantized as `export_pte` quantizes them), each fed a constant row, one output that keeps every
layer alive, lowered to XNNPACK with ExecuTorch's stock `to_edge_transform_and_lower`. It times
that program against the model's exported decode step (and, with `--compiled`, the compiled
step) in one process, interleaved round by round, with the read bandwidth between rounds. The
linears alone are what the step would cost if everything else were free: against their bytes
they say how fast XNNPACK's GEMV streams the weights here, and against the step's floor
(`readings.decode_read_bytes`, what `shram-static bench` divides by) how close to the floor
any program of these kernels can come.

`--op-cost` also times what one small op costs the runtime: programs of a chain of 2000
elementwise ops on a 16-element float tensor, delegated to XNNPACK and on portable kernels, and
on 3 int64 elements (the index bookkeeping a step leaves outside the delegates).

    python benchmarks/pte_linears.py [--model bench] [--quantize int8] [--compiled] [--op-cost] [--rounds 6] [--steps 20]
"""

import argparse
import os
import sys
import tempfile

import torch
from torch import nn


class Linears(nn.Module):
    """Every given linear layer applied to a constant row of its input width; returns each
    output's mean, concatenated.

    Args:
        linears: the nn.Linear layers (float or torchao-quantized weights).
    """

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.linears = nn.ModuleList(linears)
        self.widths = sorted({lin.in_features for lin in linears})

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        """xs: one (1, 1, w) row per input width in `self.widths` -> (len(linears),)."""
        row = dict(zip(self.widths, xs))
        # each output as a 4-D mean over its two innermost dims: a reduction XNNPACK delegates
        outs = [lin(row[lin.in_features]).view(1, 1, 1, -1).mean(dim=(2, 3)) for lin in self.linears]
        return torch.cat(outs, dim=-1).view(-1)


def linear_layers(model, quantize: str | None) -> tuple[list[nn.Linear], int]:
    """The nn.Linear layers the exported decode step of `model` runs, quantized as `export_pte`
    quantizes them, and the bytes their weights (and scales) occupy."""
    from shram_static.export.common import export_copy
    from shram_static.export.quantize import quantize_weights_

    q = export_copy(model)
    if quantize is not None:
        q = quantize_weights_(q, quantize)
    linears = [m for m in q.modules() if isinstance(m, nn.Linear)]
    nbytes = 0
    for lin in linears:
        w = lin.weight
        parts = [getattr(w, a) for a in ("qdata", "scale", "zero_point") if isinstance(getattr(w, a, None), torch.Tensor)]
        nbytes += sum(t.numel() * t.element_size() for t in parts) if parts else w.numel() * w.element_size()
    return linears, nbytes


def lower_linears(linears: list[nn.Linear]) -> tuple[bytes, list[torch.Tensor]]:
    """The `.pte` bytes of a `Linears` program of `linears`, and its inputs."""
    from executorch.exir import to_edge_transform_and_lower

    from shram_static.export.partition import xnnpack_partitioner

    mod = Linears(linears).eval()
    xs = tuple(torch.ones(1, 1, w) for w in mod.widths)
    with torch.no_grad():
        ep = torch.export.export(mod, xs, strict=False)
    return to_edge_transform_and_lower(ep, partitioner=[xnnpack_partitioner()]).to_executorch().buffer, list(xs)


class Chain(nn.Module):
    """n elementwise ops in a chain: float multiply and subtract, or integer add and remainder."""

    def __init__(self, n: int, integer: bool):
        super().__init__()
        self.n, self.integer = n, integer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n // 2):
            x = torch.remainder(x + 3, 1000) if self.integer else x * 1.0001 - 0.25
        return x


def op_chains(n: int = 2000) -> list[tuple[str, object, list, int]]:
    """(name, (loaded method, its program's bytes), inputs, ops) of three chain programs of
    about n ops (see the module docstring)."""
    from executorch.exir import to_edge, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from shram_static.export.partition import xnnpack_partitioner

    out = []
    for name, integer, delegated in (("XNNPACK, float (1, 1, 1, 16)", False, True),
                                     ("portable, float (1, 1, 1, 16)", False, False),
                                     ("portable, int64 (1, 3)", True, False)):
        x = torch.ones(1, 3, dtype=torch.long) if integer else torch.ones(1, 1, 1, 16)
        ep = torch.export.export(Chain(n, integer), (x,), strict=False)
        edge = to_edge_transform_and_lower(ep, partitioner=[xnnpack_partitioner()]) if delegated else to_edge(ep)
        buf = edge.to_executorch().buffer  # kept with the method: the runtime reads the program from it
        method = Runtime.get().load_program(buf).load_method("forward")
        out.append((name, (method, buf), [x], sum(node.op == "call_function" for node in ep.graph.nodes)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench", help="bench, builtin or a checkpoint directory")
    p.add_argument("--quantize", choices=["int8", "8da4w"], help="as `shram-static export --quantize`")
    p.add_argument("--compiled", action="store_true", help="also time the compiled decode step")
    p.add_argument("--op-cost", action="store_true", help="also time chains of small ops (per-op cost)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    from executorch.runtime import Runtime
    from onnx_matmuls import decode_loop, interleaved  # this script's folder is on sys.path

    from shram_static import StaticDecoder
    from shram_static.bench import build_model
    from shram_static.export import export_pte, load_pte
    from shram_static.export.pte_runtime import torch_threads
    from shram_static.bench.readings import decode_read_bytes

    model = build_model(args.model).eval()
    linears, nbytes = linear_layers(model, args.quantize)
    print(f"lowering {len(linears)} linear layers alone ...", file=sys.stderr)
    buf, xs = lower_linears(linears)  # kept alive with the method: the runtime reads the program from it
    method = Runtime.get().load_program(buf).load_method("forward")
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "m.pte")
    print(f"exporting {args.model}'s decode step ...", file=sys.stderr)
    export_pte(model, path, prefill_chunk=None, quantize=args.quantize)
    decoders = [("pte", load_pte(path))]
    if args.compiled:
        print("compiling its decode step ...", file=sys.stderr)
        decoders.append(("compiled", StaticDecoder(model, compile=True)))
    prompt = torch.zeros(1, 64, dtype=torch.long)

    def run(method, xs):
        def go():
            with torch_threads(1):  # as `PteDecoder` runs a step: torch's workers off XNNPACK's cores
                method.execute(xs)
        return go

    chains = op_chains() if args.op_cost else []
    runs = [(name, decode_loop(dec, prompt)) for name, dec in decoders] + [("linears", run(method, xs))]
    runs += [(name, run(m, x)) for name, (m, _), x, _ in chains]
    t, b, bw = interleaved(runs, args.rounds, args.steps)
    lin, pte = t["linears"], t["pte"]
    floor = nbytes / b * 1e3
    step_floor = decode_read_bytes(model, 1, 1, quantize=args.quantize) / b * 1e3
    kind = args.quantize or "fp32"
    print(f"{len(linears)} linear layers ({kind}), {nbytes / 1e6:.1f} MB; read bandwidth {b / 1e9:.1f} GB/s "
          f"(median of {len(bw)}): their floor {floor:.2f} ms, the decode step's floor {step_floor:.2f} ms")
    print(f"linears alone in ExecuTorch {lin:.2f} ms ({nbytes / lin / 1e6:.1f} GB/s, {lin / floor:.2f}x their "
          f"floor, {lin / step_floor:.2f}x the step's); the .pte decode step {pte:.2f} ms "
          f"({pte / step_floor:.2f}x its floor): the linears are {lin / pte:.0%} of it")
    if "compiled" in t:
        c = t["compiled"]
        print(f"the compiled decode step {c:.2f} ms: the .pte step {c / pte:.2f}x its speed, the linears "
              f"alone {c / lin:.2f}x")
    for name, _, _, ops in chains:
        print(f"{ops} ops, {name}: {t[name]:.3f} ms, {t[name] / ops * 1e3:.3f} us per op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
