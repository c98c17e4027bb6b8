"""Two decoders' decode steps against each other in one process, free of load order.

A one-process A/B that loads A, then B, and times them in a fixed order reads a bias as a speed
difference: the program loaded (or compiled) first can run a few percent slower than a second
copy of itself. This builds A, B, B, A, times each for `--steps` decode steps per turn, runs the
four in alternating directions round by round, and reports B/A from the pairs' sums (below 1: B
is faster). Use it to decide whether a change pays, on the same machine, in one run.

A and B are each an exported file (`.pte`, or the decode graph `.onnx`) or a PyTorch decoder of
`--model`: `eager`, `compiled`, or either with `StaticDecoder` options, e.g.
`compiled:verify_len=4`. Run one side with the accelerators off by giving it its own process
instead (`SHRAM_STATIC_STOCK=1`), since that switch is read per process.

    python benchmarks/abba.py old.pte new.pte [--rounds 20]
    python benchmarks/abba.py old.onnx new.onnx
    python benchmarks/abba.py compiled:verify_len=4 compiled --model bench
"""

import argparse
import collections
import statistics
import sys
import time

import torch


def build(spec: str, model_name: str, batch_size: int):
    """A decoder from a spec: a `.pte` / `.onnx` path, or `eager` / `compiled[:key=value,...]`."""
    if spec.endswith(".pte"):
        from shram_static.export import load_pte
        return load_pte(spec)
    if spec.endswith(".onnx"):
        from shram_static.export import load_onnx
        return load_onnx(spec)
    kind, _, opts = spec.partition(":")
    if kind not in ("eager", "compiled"):
        raise ValueError(f"{spec!r}: expected a .pte or .onnx file, 'eager' or 'compiled[:key=value,...]'")
    from shram_static import StaticDecoder
    from shram_static.bench import build_model

    kw = {}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        kw[key] = int(value)
    return StaticDecoder(build_model(model_name).eval(), batch_size=batch_size, compile=kind == "compiled", **kw)


def measure(decoders: list, rounds: int, steps: int = 10, context: int = 8) -> dict[str, list[float]]:
    """Per round: each decoder's median decode ms over `steps` steps, and "B/A".

    Args:
        decoders: [("A1", a), ("B1", b), ("B2", b'), ("A2", a')], same config and batch size.
        rounds: turns of all four (reversed every other round).
        steps: timed decode steps per decoder and turn.
        context: tokens prefilled before timing (and again whenever a row nears capacity).
    """
    V, B = decoders[0][1].config.vocab_size, decoders[0][1].batch_size
    ids = torch.randint(0, V, (B, context + 1), generator=torch.Generator().manual_seed(0))
    for _, d in decoders:  # the first calls (a compile, a runtime's warm-up) are not timed
        d.prefill(ids[:, :context])
        d.decode(ids[:, context])
    times = collections.defaultdict(list)
    for r in range(rounds):
        for name, d in (decoders if r % 2 == 0 else decoders[::-1]):
            if int(d.live_counts.max()) + steps > d.capacity:  # stay within the state's capacity
                d.reset()
                d.prefill(ids[:, :context])
            ts = []
            for _ in range(steps):
                t = time.perf_counter()
                d.decode(ids[:, context])
                ts.append(time.perf_counter() - t)
            times[name].append(statistics.median(ts) * 1e3)
        times["B/A"].append((times["B1"][-1] + times["B2"][-1]) / (times["A1"][-1] + times["A2"][-1]))
    return dict(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="decoder A (the baseline): FILE.pte, FILE.onnx, eager or compiled[:key=value,...]")
    p.add_argument("b", help="decoder B, as A")
    p.add_argument("--model", default="bench", help="for eager/compiled: bench, builtin or a checkpoint directory")
    p.add_argument("--batch-size", type=int, default=1, help="for eager/compiled (a file has its own)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per decoder and round")
    args = p.parse_args(argv)
    decoders = [(name, build(spec, args.model, args.batch_size))
                for name, spec in (("A1", args.a), ("B1", args.b), ("B2", args.b), ("A2", args.a))]
    times = measure(decoders, args.rounds, args.steps)
    for k, v in times.items():
        print(f"{k}: median {statistics.median(v):.3f}" + (" ms/step" if k != "B/A" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
