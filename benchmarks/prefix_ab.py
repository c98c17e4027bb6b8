"""Exported steps over a prefix of the sparse caches against whole-cache ones, interleaved.

Exports the bench model at a chosen capacity twice for one backend: with the default prefix
lengths (every step method / graph takes the `slots` it attends, the runner picks the length)
and with `prefix_lengths=()` (whole-cache steps). Reports each export's
time, then, round by round in alternating order, prefill tokens/s of a short prompt (last-token
logits, as generation reads them) and decode ms per step right after it; with
`--baseline-capacity`, a whole-cache export at that capacity too, in the same rounds.

    python benchmarks/prefix_ab.py --backend pte --capacity 8192 --prompt 256 --rounds 6 --baseline-capacity 2048
    python benchmarks/prefix_ab.py --backend onnx --capacity 8192 --prompt 256 --rounds 6
"""

import argparse
import statistics
import sys
import tempfile
import time


def build(capacity: int):
    """The bench model (`shram_static.bench` BENCH_CONFIG, its seeded weights) at `capacity`."""
    import torch

    from shram_static.bench.throughput import BENCH_CONFIG
    from shram_static.config import ShramConfig
    from shram_static.model import ShramForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ShramForCausalLM(ShramConfig(**{**BENCH_CONFIG, "inference_sequence_length": capacity})).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("pte", "onnx"), required=True)
    p.add_argument("--capacity", type=int, default=8192, help="inference_sequence_length of the bench model")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens prefilled per timed run")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed after each prompt")
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prefix-decode", action="store_true",
                   help="pte: the prefix export gets the batch-1 decode method over a prefix (`prefix_decode`)")
    p.add_argument("--baseline-capacity", type=int,
                   help="also time a whole-cache export at this (smaller) capacity in the same rounds")
    p.add_argument("--out-dir", help="keep the exports here, and reuse those already there (default: a temporary folder)")
    args = p.parse_args(argv)
    import os

    import torch

    from shram_static.export import export_onnx, export_pte, load_onnx, load_pte

    tmp = tempfile.TemporaryDirectory()
    out = args.out_dir or tmp.name
    decoders = {}
    runs = [("whole", (), args.capacity), ("prefix", None, args.capacity)]
    if args.baseline_capacity:
        runs.append((f"whole-{args.baseline_capacity}", (), args.baseline_capacity))
    for name, lengths, capacity in runs:
        t = time.perf_counter()
        path = os.path.join(out, f"{name}.{args.backend}")
        if not os.path.exists(path):
            model = build(capacity)
            if args.backend == "pte":
                export_pte(model, path, prefill_chunk=args.prefill_chunk, prefix_lengths=lengths,
                           prefix_decode=args.prefix_decode and name == "prefix")
            else:
                export_onnx(model, path, prefill_chunk=args.prefill_chunk, prefix_lengths=lengths)
            print(f"{name}: export {time.perf_counter() - t:.0f} s", flush=True)
        decoders[name] = (load_pte if args.backend == "pte" else load_onnx)(path)
        print(f"{name}: prefix lengths {decoders[name].meta.get('prefix_lengths')}", flush=True)
    ids = torch.randint(0, decoders["whole"].config.vocab_size, (1, args.prompt + args.decode_steps),
                        generator=torch.Generator().manual_seed(0))
    for dec in decoders.values():  # the runtimes' first calls are not timed
        dec.reset()
        dec.prefill(ids[:, :args.prompt], last_only=True)
    rates, steps = {n: [] for n in decoders}, {n: [] for n in decoders}
    for r in range(args.rounds):
        for name, dec in (list(decoders.items()) if r % 2 == 0 else list(decoders.items())[::-1]):
            dec.reset()
            t = time.perf_counter()
            dec.prefill(ids[:, :args.prompt], last_only=True)
            rates[name].append(args.prompt / (time.perf_counter() - t))
            ts = []
            for i in range(args.decode_steps):
                t = time.perf_counter()
                dec.decode(ids[:, args.prompt + i])
                ts.append(time.perf_counter() - t)
            steps[name].append(statistics.median(ts) * 1e3)
    for name in decoders:
        if name.startswith("whole-"):
            ratio = statistics.median(a / b for a, b in zip(rates["prefix"], rates[name]))
            print(f"prefix/{name} prefill rate: median {ratio:.2f}x")
        print(f"{name}: prefill {statistics.median(rates[name]):.0f} tokens/s (rounds {[round(x) for x in rates[name]]}), "
              f"decode {statistics.median(steps[name]):.2f} ms/step")
    ratio = [a / b for a, b in zip(rates["prefix"], rates["whole"])]
    print(f"prefix/whole prefill rate: median {statistics.median(ratio):.2f}x per round {[round(x, 2) for x in ratio]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
