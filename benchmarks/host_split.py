"""Where a compiled `decode()` call's time goes: the whole call against its step function alone.

Per round: `--steps` calls of `StaticDecoder.decode` (each timed alone, then rolled back), and
as many calls of the decode step function (`step_function("decode")`) on the same inputs, the
two loops in alternating order. The difference is the package's own host work around the step
(input checks, counts, prefix slots, the logits' check); the step function's time holds
Dynamo's and AOTAutograd's call path and Inductor's wrapper around the kernels.

    python benchmarks/host_split.py [--model builtin] [--rounds 8] [--steps 300] [--context 64]
"""

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--context", type=int, default=64, help="tokens prefilled before the decode calls")
    args = ap.parse_args(argv)

    import torch

    from shram_static import StaticDecoder
    from shram_static.bench import build_model
    from shram_static.state import PrefixSlots

    torch.manual_seed(0)
    m = build_model(args.model).eval()
    dec = StaticDecoder(m, batch_size=1, prefill_chunk=32, compile=True)
    V, N = m.config.vocab_size, args.context
    ids = torch.randint(0, V, (1, N + args.steps), generator=torch.Generator().manual_seed(0))
    dec.prefill(ids[:, :N], last_only=True)
    tok = ids[0, N:].clone()  # (steps,) one token per call
    dec.decode(tok[:1])
    dec.rollback(1)
    fn = dec.step_function("decode")
    pos = dec.live_counts
    args_fn = (tok[:1, None].clone(), pos, torch.ones(1, 1, dtype=torch.bool),
               PrefixSlots(m.config, dec.prefix_lengths)(pos, 1))
    got = {"decode()": [], "step function": []}
    for r in range(args.rounds):
        for what in (("decode()", "step function") if r % 2 == 0 else ("step function", "decode()")):
            total = 0.0
            with torch.no_grad():
                for i in range(args.steps):
                    if what == "decode()":
                        t = time.perf_counter()
                        dec.decode(tok[i:i + 1])
                        total += time.perf_counter() - t
                        dec.rollback(1)
                    else:
                        t = time.perf_counter()
                        fn(*args_fn)
                        total += time.perf_counter() - t
            got[what].append(total / args.steps)
    d, s = (statistics.median(got[k]) for k in ("decode()", "step function"))
    print(f"{args.model} compiled, context {N}: decode() {d * 1e3:.3f} ms, its step function alone "
          f"{s * 1e3:.3f} ms, the package's host work {(d - s) * 1e3:.3f} ms ({(d - s) / d:.0%} of the call)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
