"""Where the compiled decode step's time goes, per Inductor kernel and host-side call.

Compiles `StaticDecoder(compile=True)` at each batch size, fills the state to `--context`, then
runs `--steps` decode steps (or, with `--verify K`, verify steps of K + 1 tokens, each rolled
back) under torch.profiler with Inductor's per-kernel profiling on
(`cpp.enable_kernel_profile`, which names each generated C++ kernel in the trace), and prints
the entries that take the most self CPU time per step; for the decode step also the step's and
its C++ kernels' time against the floor (the bytes a step reads over the memory bandwidth
measured right after).

    python benchmarks/compiled_profile.py [--model bench|builtin|DIR] [--batch-sizes 1 4] [--verify K]
        [--quantize int8|int4]
"""

import argparse
import sys
import time

import torch


def profile(model, batch_size: int, context: int, steps: int, top: int, verify: int = 0,
            quantize: str | None = None) -> None:
    """Prints the warm-up time, ms per step under the profiler, and the top entries."""
    from shram_static import StaticDecoder

    V, B = model.config.vocab_size, batch_size
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=32, compile=True, verify_len=verify + 1 if verify else None,
                        quantize=quantize)
    ids = torch.randint(0, V, (B, context + verify + 1), generator=torch.Generator().manual_seed(0))

    def one_step():
        if verify:
            dec.verify(ids[:, context:context + verify + 1])
            dec.rollback(verify + 1)
        else:
            dec.decode(ids[:, context])

    t = time.perf_counter()
    dec.prefill(ids[:, :context])
    for _ in range(6):
        one_step()
    print(f"B={B}: warm-up {time.perf_counter() - t:.1f} s")
    if int(dec.live_counts.max()) + steps > dec.capacity:
        raise ValueError(f"--context {context} + --steps {steps} exceed the capacity {dec.capacity}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            one_step()
        wall = (time.perf_counter() - t) / steps * 1e3
    print(f"B={B}: {wall:.2f} ms/step under the profiler")
    rows = sorted(((e.self_cpu_time_total / steps / 1e3, e.count // steps, e.key) for e in prof.key_averages()),
                  reverse=True)
    print(f"  self CPU ms/step total {sum(r[0] for r in rows):.2f}")
    if not verify:  # the decode step against its floor, the bandwidth read right after it
        from shram_static.bench.readings import decode_read_bytes, measure_bandwidth
        floor = 1e3 * decode_read_bytes(model, B, 32, quantize, compiled_ops=True) / measure_bandwidth()
        kernels = sum(ms for ms, _, key in rows if "cpp_fused" in key or "shram_static::" in key)
        print(f"  floor {floor:.2f} ms: the step {wall / floor:.2f}x it, its C++ kernels ({kernels:.2f} ms) "
              f"{kernels / floor:.2f}x")
    for ms, n, key in rows[:top]:
        print(f"  {ms:7.3f} ms  x{n:<4d} {key[:90]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench", help="bench, builtin or a checkpoint directory")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=64, help="tokens prefilled before profiling")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25, help="entries printed per batch size")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="profile the verify step of K + 1 tokens instead of the decode step")
    p.add_argument("--quantize", choices=["int8", "int4"], help="the compiled-int8 / -int4 backend's layers")
    args = p.parse_args(argv)
    from shram_static.bench import build_model

    model = build_model(args.model).eval()
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        for B in args.batch_sizes:
            profile(model, B, args.context, args.steps, args.top, args.verify, args.quantize)
    return 0


if __name__ == "__main__":
    sys.exit(main())
