"""What a prompt's prefill saves by taking each row's last token's logits only.

Prefills the same prompt on one compiled `StaticDecoder`, alternating `prefill(ids)` (every
chunk's (B, C, V) logits: the lm_head over all C tokens) and `prefill(ids, last_only=True)`
(its own compiled step: the lm_head over each row's last live token), and prints the median
tokens/s of each and their ratio; the two give the same last-token logits (checked).

    python benchmarks/prefill_last.py [--model bench|builtin|DIR] [--tokens 256] [--chunk 32]
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench", help="bench, builtin or a checkpoint directory")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk")
    ap.add_argument("--rounds", type=int, default=4, help="prefills of each kind, alternating")
    args = ap.parse_args()
    from shram_static import StaticDecoder
    from shram_static.bench import build_model

    model = build_model(args.model).eval()
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=args.chunk, compile=True)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    for last_only in (False, True):  # the first call of each compiles its step
        t = time.perf_counter()
        dec.reset()
        dec.prefill(ids[:, :args.chunk], last_only=last_only)
        print(f"warm-up, last_only={last_only}: {time.perf_counter() - t:.1f} s")
    times = {False: [], True: []}
    for r in range(args.rounds):
        for last_only in ((True, False) if r % 2 else (False, True)):
            dec.reset()
            t = time.perf_counter()
            out = dec.prefill(ids, last_only=last_only)
            times[last_only].append(time.perf_counter() - t)
            got = out if last_only else out[:, -1]
            if r == 0:
                times.setdefault("logits", []).append(got)
    torch.testing.assert_close(times["logits"][0], times["logits"][1], atol=1e-4, rtol=1e-4)
    full, last = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}, {args.tokens} tokens in chunks of {args.chunk}: every token's logits "
          f"{args.tokens / full:.0f} tok/s, last token's only {args.tokens / last:.0f} tok/s ({full / last:.2f}x)")


if __name__ == "__main__":
    main()
