"""Probe: two exported artifacts' decode steps A/B in one process, free of load-order bias.

A one-process A/B that loads A, then B, and times them in a fixed order reads a bias as a speed
difference: the program loaded first ran 2-5% slower than a second copy of itself here
(section 24). This loads A, B, B, A, times each for 10 steps per turn, runs the four in
alternating directions round by round, and reports B/A from the pairs' sums.

Run: python export/probes/probe_abba.py pte|onnx A B [ROUNDS]
"""

import collections
import statistics
import sys
import time

import torch

from shram_static.export import load_onnx, load_pte


def main(kind: str, a: str, b: str, rounds: int) -> None:
    load = load_pte if kind == "pte" else load_onnx
    decs = [("A1", load(a)), ("B1", load(b)), ("B2", load(b)), ("A2", load(a))]
    V, B = decs[0][1].config.vocab_size, decs[0][1].batch_size
    ids = torch.randint(0, V, (B, 64), generator=torch.Generator().manual_seed(0))
    for _, d in decs:
        d.prefill(ids[:, :8])
        d.decode(ids[:, 8])
    times = collections.defaultdict(list)
    for r in range(rounds):
        for name, d in (decs if r % 2 == 0 else decs[::-1]):
            if int(d.live_counts.max()) + 10 > d.capacity:  # keep within the state's capacity
                d.reset()
                d.prefill(ids[:, :8])
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                d.decode(ids[:, 8])
                ts.append(time.perf_counter() - t)
            times[name].append(statistics.median(ts) * 1e3)
        times["B/A"].append((times["B1"][-1] + times["B2"][-1]) / (times["A1"][-1] + times["A2"][-1]))
    for k, v in times.items():
        print(f"{k}: median {statistics.median(v):.3f}" + (" ms" if k != "B/A" else ""))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 20)
