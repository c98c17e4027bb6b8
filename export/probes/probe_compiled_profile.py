"""Where the compiled decode step's time goes (bench config), per Inductor kernel.

Compiles `StaticDecoder(compile=True)` at each batch size, fills the state to `--ctx`, then
runs `--steps` decode steps under torch.profiler with Inductor's per-kernel profiling on, and
prints the kernels that take the most self CPU time per step.

Run:  python export/probes/probe_compiled_profile.py --batch-sizes 1 4
"""

import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    torch._inductor.config.cpp.enable_kernel_profile = True  # names each C++ kernel in the trace
    from shram_static import StaticDecoder
    from shram_static.bench import build_model

    model = build_model("bench").eval()
    V = model.config.vocab_size
    for B in a.batch_sizes:
        dec = StaticDecoder(model, batch_size=B, prefill_chunk=32, compile=True)
        ids = torch.randint(0, V, (B, a.ctx + a.steps + 8), generator=torch.Generator().manual_seed(0))
        t = time.perf_counter()
        dec.prefill(ids[:, :a.ctx])
        dec.decode(ids[:, a.ctx])
        print(f"B={B}: warm-up {time.perf_counter() - t:.1f} s")
        for i in range(5):
            dec.decode(ids[:, a.ctx + 1 + i])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for i in range(a.steps):
                dec.decode(ids[:, a.ctx + 6 + i] if a.ctx + 6 + i < ids.shape[1] else ids[:, 0])
            wall = (time.perf_counter() - t) / a.steps * 1e3
        print(f"B={B}: {wall:.2f} ms/step under the profiler")
        rows = [(e.self_cpu_time_total / a.steps / 1e3, e.count // a.steps, e.key) for e in prof.key_averages()]
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"  self CPU ms/step total {total:.2f}")
        for ms, n, key in rows[:a.top]:
            print(f"  {ms:7.3f} ms  x{n:<4d} {key[:90]}")


if __name__ == "__main__":
    main()
