"""Inductor options for the compiled decode and verify steps, against the decoder's own, in one process.

Builds two compiled `StaticDecoder`s of one model at batch 1. A compiles its steps with the
options the decoder uses (`decoder.STEP_OPTIONS`, plus `ROW_INPUTS_STORED` for the verify
step); B with those options updated by `--set` (a JSON object of Inductor options) or with the
keys of `--unset` removed (each step a code object of its own, so Dynamo compiles each side
anew). Both prefill `--context` tokens, then per round each times `--steps` decode steps and
`--steps` verify steps of 5 tokens (each rolled back), the two sides' order reversed every
other round. Prints the largest logit difference between the sides and each step's B/A from
the medians (below 1: B is faster).

    python benchmarks/inductor_options.py --unset cpp.enable_floating_point_contract_flag
    python benchmarks/inductor_options.py --model bench --set '{"cpp.enable_unsafe_math_opt_flag": true}'
    python benchmarks/inductor_options.py --set '{"cpp_wrapper": true}' [--quantize int8]   # B's layers unrolled by its decoder
"""

import argparse
import json
import statistics
import sys
import time

import torch


def compiled_decoder(model, options: dict, quantize: str | None = None):
    """A batch-1 compiled StaticDecoder whose steps add `options` to their own (each decoder's
    steps are code objects of its own: they compile on their own)."""
    from shram_static import decoder as D
    return D.StaticDecoder(model, batch_size=1, prefill_chunk=32, compile=True, verify_len=5, options=options,
                          quantize=quantize)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin", help="'builtin', 'bench' or a checkpoint directory")
    p.add_argument("--set", default="{}", help="JSON object: Inductor options B sets")
    p.add_argument("--unset", nargs="*", default=[], help="options of the decoder's that B leaves out")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=0, help="steps per turn (default: 50 built-in, 5 otherwise)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--quantize", choices=["int8", "int4"], help="both sides' layers as compiled-int8 / -int4's")
    args = p.parse_args(argv)
    from shram_static import decoder as D
    from shram_static.bench import build_model

    model = build_model(args.model).eval()
    base = dict(D.STEP_OPTIONS)
    other = {k: v for k, v in {**base, **json.loads(args.set)}.items() if k not in args.unset}
    print(f"A: {base}\nB: {other}")
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids, prompt = torch.randint(0, V, (1, 5), generator=gen), torch.randint(0, V, (1, args.context), generator=gen)
    sides = {"A": compiled_decoder(model, base, args.quantize), "B": compiled_decoder(model, other, args.quantize)}
    one, five = torch.ones(1, 1, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)
    logits = {}  # side -> (decode logits, verify logits) at the same position
    for name, dec in sides.items():
        dec.prefill(prompt, last_only=True)
        t0 = time.perf_counter()
        lg1 = dec.feed(ids[:, :1], one)
        dec.forget(torch.tensor([1]))
        t1 = time.perf_counter()
        logits[name] = (lg1, dec.feed(ids, five))
        dec.forget(torch.tensor([5]))
        print(f"{name}: first decode {t1 - t0:.1f} s, first verify {time.perf_counter() - t1:.1f} s "
              f"(compiles, unless Inductor's cache holds them)")
    print(f"largest logit difference B - A: decode {(logits['A'][0] - logits['B'][0]).abs().max():.2e}, "
          f"verify {(logits['A'][1] - logits['B'][1]).abs().max():.2e}")
    n = args.steps or (50 if args.model == "builtin" else 5)
    times = {(s, k): [] for s in sides for k in ("decode", "verify")}
    for r in range(args.rounds):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            dec = sides[name]
            t0 = time.perf_counter()
            for _ in range(n):
                dec.feed(ids[:, :1], one)
                dec.forget(torch.tensor([1]))
            t1 = time.perf_counter()
            for _ in range(n):
                dec.feed(ids, five)
                dec.forget(torch.tensor([5]))
            times[(name, "decode")].append((t1 - t0) / n)
            times[(name, "verify")].append((time.perf_counter() - t1) / n)
    for k in ("decode", "verify"):
        a, b = statistics.median(times[("A", k)]), statistics.median(times[("B", k)])
        print(f"{k}: A {a * 1e3:.3f} ms, B {b * 1e3:.3f} ms, B/A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
