"""RowLinear's packed layout against the alternatives, at 1 to 8 rows.

Times, compiled, the bench model's MLP projections (12 layers of 512 -> 1366 and 1366 -> 512
weights, 67 MB) as:

- `packed`: `RowLinear` (the weight packed in blocks of 16 outputs, one vector accumulator per
  row; what the compiled decode and verify steps run);
- `row-major`: per row, a product with the (out, in) weight summed over `in` (one horizontal
  reduction per output and row; Inductor fuses the rows into one pass with n accumulators);
- `F.linear`: MKL's GEMV / sgemm.

Each round times every form in turn (order alternating), `--calls` calls each; it prints the
median ms per call and the weight bytes over that time.

    python benchmarks/row_linear.py [--rows 1 5] [--rounds 6]
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def forms(weights: list[torch.Tensor]) -> dict:
    """name -> compiled function of (x_in (n, 512), x_mid (n, 1366)) -> list of outputs."""
    from shram_static.fast_layers import RowLinear

    lins = [RowLinear(w) for w in weights]

    def packed(x, x2):
        return [lin(x if w.shape[1] == x.shape[1] else x2) for lin, w in zip(lins, weights)]

    def row_major(x, x2):
        out = []
        for w in weights:
            xs = x if w.shape[1] == x.shape[1] else x2
            out.append(torch.stack([(xs[r] * w).sum(-1) for r in range(xs.shape[0])]))
        return out

    def linear(x, x2):
        return [F.linear(x if w.shape[1] == x.shape[1] else x2, w) for w in weights]

    return {name: torch.compile(f, fullgraph=True, dynamic=False)
            for name, f in (("packed", packed), ("row-major", row_major), ("F.linear", linear))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    d, h = 512, 1366
    weights = [torch.randn(h, d, generator=gen) for _ in range(12)] + [torch.randn(d, h, generator=gen) for _ in range(12)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    fs = forms(weights)
    with torch.no_grad():
        for n in args.rows:
            x, x2 = torch.randn(n, d, generator=gen), torch.randn(n, h, generator=gen)
            want = [(x.double() if w.shape[1] == d else x2.double()) @ w.double().t() for w in weights]
            for name, f in fs.items():  # compile, and check the values
                err = max((a.double() - b).abs().max().item() for a, b in zip(f(x, x2), want))
                assert err < 1e-2, f"{name}: max error {err}"
            times = {name: [] for name in fs}
            for r in range(args.rounds):
                for name, f in (list(fs.items()) if r % 2 == 0 else list(fs.items())[::-1]):
                    f(x, x2)
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        f(x, x2)
                    times[name].append((time.perf_counter() - t) / args.calls)
            line = []
            for name, ts in times.items():
                m = statistics.median(ts)
                line.append(f"{name} {m * 1e3:.2f} ms ({nbytes / m / 1e9:.1f} GB/s)")
            print(f"{n} row{'s' if n > 1 else ''}: " + ", ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
