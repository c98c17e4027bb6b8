"""Cold compile warm-up of the bench model, with and without the combined kernel builds.

Each run is a fresh process with a fresh Inductor cache (a new user's first run): it builds a
compiled `StaticDecoder`, runs one prefill chunk and one decode step, and prints every g++ run
(start, seconds, thread, file) and the warm-up time. `--modes on off` alternates the code as
it is (`on`) with `shram_static.kernel_builds` switched off (`off`: one file per kernel, as
Inductor builds them), `--rounds` times, so both see the same load.

Run:  python export/probes/probe_warmup.py --modes on off --rounds 2 [--batch-size 4]
"""

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import contextlib, sys, threading, time
t0 = time.perf_counter()
import torch
from torch._inductor import cpp_builder
build = cpp_builder.CppBuilder.build
runs = []
def timed(self):
    t = time.perf_counter(); r = build(self); runs.append((t - t0, time.perf_counter() - t,
        threading.current_thread().name, self._name[:12])); return r
cpp_builder.CppBuilder.build = timed
import shram_static.decoder as D
if sys.argv[1] == "off":
    D.batched_builds = contextlib.nullcontext
from shram_static.bench import build_model
model = build_model("bench")
t = time.perf_counter()
B = int(sys.argv[2])
dec = D.StaticDecoder(model, batch_size=B, prefill_chunk=32, compile=True)
ids = torch.zeros(B, 32, dtype=torch.long)
dec.prefill(ids, last_only=True)
t_prefill = time.perf_counter() - t
dec.decode(ids[:, 0])
total = time.perf_counter() - t
for r in runs:
    print(f"  g++ at {r[0]:6.2f} s: {r[1]:5.2f} s  {r[2]:<24} {r[3]}")
print(f"{sys.argv[1]} (batch {B}): {len(runs)} g++ runs, {sum(r[1] for r in runs):.1f} s; prefill compiled "
      f"after {t_prefill:.1f} s, warm-up {total:.1f} s", flush=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1)
    a = ap.parse_args()
    for _ in range(a.rounds):
        for mode in a.modes:
            with tempfile.TemporaryDirectory(prefix="probe_warmup_") as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                subprocess.run([sys.executable, "-c", CHILD, mode, str(a.batch_size)], env=env, check=True)


if __name__ == "__main__":
    main()
