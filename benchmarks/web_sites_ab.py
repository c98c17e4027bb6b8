"""Two exported web sites of one model A-B under Node: decode tokens/s of each site's module.

For each runtime (onnxruntime-node, onnxruntime-web's WASM; one thread), both sites load once in
a worker each (`web_node_worker.mjs`), generate for `--warmup-s` seconds, then alternate
`--rounds` greedy generations of `--tokens` tokens from the same prompt (the order reversed every
other round). Prints each side's median and B/A (above 1: B is faster). For a change to the
exporter: export the site with each tree, then compare them here.

    python benchmarks/web_sites_ab.py SITE_A SITE_B [--runtimes node,web] [--tokens 128] [--rounds 6]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from web_speed import NodeWorker  # noqa: E402  (a sibling script, not a package)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--runtimes", default="node,web", help="comma-separated: node (onnxruntime-node), web (WASM)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup-s", type=float, default=3.0)
    args = p.parse_args(argv)
    prompt = list(b"ROMEO:")
    for rt in [r.strip() for r in args.runtimes.split(",") if r.strip()]:
        workers = {"A": NodeWorker(rt, args.a), "B": NodeWorker(rt, args.b)}
        try:
            for w in workers.values():
                t = time.perf_counter()
                while time.perf_counter() - t < args.warmup_s:
                    w.run(prompt, 32)
            rates = {k: [] for k in workers}
            for r in range(args.rounds):
                for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
                    rates[k].append(workers[k].run(prompt, args.tokens)["decodeTokensPerSecond"])
        finally:
            for w in workers.values():
                w.close()
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"{rt}: A {med['A']:.1f} tok/s, B {med['B']:.1f} tok/s, B/A {med['B'] / med['A']:.3f} "
              f"(A {min(rates['A']):.1f}-{max(rates['A']):.1f}, B {min(rates['B']):.1f}-{max(rates['B']):.1f})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
