"""One backend with accelerators off against on, each in a worker process of its own,
interleaved.

`SHRAM_STATIC_STOCK` is read per process, and a compiled graph's generated code is shared by
every decoder of the same graph in a process, so a process-wide accelerator cannot be A/B'd in
one process (`benchmarks/abba.py`). This starts two `shram-static bench` workers of the same
model, backend and batch size, one with `SHRAM_STATIC_STOCK=<names>`, loads both, then times
them in turn at the first and last context, the order reversed every round, and reports the
medians' ratio (below 1: the accelerated side is faster), and each worker's warm-up (for a
compiled backend: a cold compile, each worker with an empty Inductor cache of its own; the two
load one after the other). An exported backend (`pte`,
`pte-int8`, `onnx`, ...) is exported once, here, and both workers load that file.

    python benchmarks/stock_ab.py isa_check_ahead,batched_kernel_builds [--model bench] [--batch-size 4] [--rounds 8]
    python benchmarks/stock_ab.py xnnpack_weight_cache --model bench --backend pte
    python benchmarks/stock_ab.py batched_kernel_builds --model bench --cold-rounds 2

With `--cold-rounds N` it times only cold warm-ups instead: N per side, each in a fresh worker
with an empty Inductor cache, in the order stock, accelerated, accelerated, stock, ... (the first
compile in a while pays for reading the compiler's files from disk).
"""

import argparse
import os
import statistics
import tempfile

from shram_static.bench import Worker, export_one


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stock", help="what SHRAM_STATIC_STOCK is on the stock side: 1 (all) or names")
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--backend", default="compiled")
    ap.add_argument("--batch-size", default="1")
    ap.add_argument("--steps", default="16", help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cold-rounds", type=int, default=0, help="time N cold warm-ups per side instead")
    args = ap.parse_args(argv)

    chunk = 32  # `shram-static bench`'s default
    opts = ["--model", args.model, "--backend", args.backend, "--batch-size", args.batch_size,
            "--steps", args.steps, "--prefill-chunk", str(chunk)]
    with tempfile.TemporaryDirectory(prefix="stock_ab_") as out:
        if args.backend not in ("eager", "compiled"):
            print(f"exporting {args.model} as {args.backend} ...", flush=True)
            export_one(args.model, args.backend, int(args.batch_size), chunk, out)
            opts += ["--out-dir", out]
        return cold(args, opts) if args.cold_rounds else ab(args, opts)


def start(opts: list[str], side: str, stock: str, cache: str) -> Worker:
    """A worker with SHRAM_STATIC_STOCK=stock and an Inductor cache of its own at `cache`."""
    keys = ("SHRAM_STATIC_STOCK", "TORCHINDUCTOR_CACHE_DIR")
    before = {k: os.environ.get(k) for k in keys}
    try:
        os.environ["SHRAM_STATIC_STOCK"] = stock  # the worker inherits both
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold compile of its own
        return Worker(opts, side)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cold(args, opts: list[str]) -> int:
    """Times `--cold-rounds` cold warm-ups per side, ABBA, one fresh worker each."""
    got = {"stock": [], "accelerated": []}
    for r in range(args.cold_rounds):
        for side in (("stock", "accelerated") if r % 2 == 0 else ("accelerated", "stock")):
            with tempfile.TemporaryDirectory(prefix="stock_ab_inductor_") as cache:
                w = start(opts, side, args.stock if side == "stock" else "", cache)
                try:
                    w.started()
                    got[side].append(w.load()["warmup_s"])
                finally:
                    w.close()
            print(f"  {side}: cold warm-up {got[side][-1]:.1f} s", flush=True)
    a, s = (statistics.median(got[k]) for k in ("accelerated", "stock"))
    print(f"{args.model} {args.backend} B={args.batch_size}: cold warm-up {a:.1f} s accelerated, "
          f"{s:.1f} s stock ({a / s:.3f}x)")
    return 0


def ab(args, opts: list[str]) -> int:
    """Starts the two workers with `opts`, times them and prints the ratios."""
    workers = {}
    caches = [tempfile.TemporaryDirectory(prefix="stock_ab_inductor_") for _ in range(2)]
    for (side, env), cache in zip((("stock", args.stock), ("accelerated", "")), caches):
        workers[side] = start(opts, side, env, cache.name)
    try:
        for w in workers.values():
            w.started()
        warm = {side: w.load()["warmup_s"] for side, w in workers.items()}
        print(f"{args.model} {args.backend} B={args.batch_size}: warm-up {warm['accelerated']:.1f} s "
              f"accelerated, {warm['stock']:.1f} s stock ({warm['accelerated'] / warm['stock']:.3f}x)",
              flush=True)
        ctx = workers["stock"].contexts
        ctx = [ctx[0], ctx[-1]]
        got = {(s, c): [] for s in workers for c in ctx}
        for r in range(args.rounds):
            for c in ctx:
                for side in (list(workers) if r % 2 == 0 else list(workers)[::-1]):
                    m = workers[side].measure(c)
                    got[side, c].append((statistics.median(m["decode_s"]) * 1e3, m["prefill_s"]))
        for c in ctx:
            dec = {s: statistics.median(x[0] for x in got[s, c]) for s in workers}
            pre = {s: statistics.median(x[1] for x in got[s, c]) for s in workers}
            print(f"{args.model} {args.backend} B={args.batch_size} context {c}: decode step "
                  f"{dec['accelerated']:.3f} ms accelerated, {dec['stock']:.3f} ms stock "
                  f"({dec['accelerated'] / dec['stock']:.3f}x); prefill "
                  f"{pre['accelerated'] / pre['stock']:.3f}x")
        for w in workers.values():
            w.finish()
    finally:
        for w in workers.values():
            w.close()
        for c in caches:
            c.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
