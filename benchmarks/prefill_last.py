"""What a prompt's prefill saves by taking each row's last token's logits only.

Prefills the same prompt, alternating the two ways, and prints the median tokens/s of each and
their ratio; the two give the same last-token logits (checked).

  * `--backend compiled` (default): one compiled `StaticDecoder`, `prefill(ids)` (every chunk's
    (B, C, V) logits: the lm_head over all C tokens) against `prefill(ids, last_only=True)` (its
    own compiled step: the lm_head over each row's last live token).
  * `--backend pte` / `onnx`: two exports of the model, `full_logits=True` (the prefill step
    computes every token's logits; the host keeps the last) against the default (the prefill
    step computes the last token's only), each run as generation runs it,
    `prefill(ids, last_only=True)`. Exporting the bench model twice takes minutes.

    python benchmarks/prefill_last.py [--model bench|builtin|DIR] [--backend compiled|pte|onnx]
                                      [--tokens 256] [--chunk 32]
"""

import argparse
import os
import statistics
import tempfile
import time

import torch


def exported(model, backend: str, chunk: int, out: str, full_logits: bool):
    """A loaded export of `model` whose prefill step keeps every token's logits or the last's."""
    from shram_static.export import export_onnx, export_pte, load_onnx, load_pte

    t = time.perf_counter()
    path = os.path.join(out, f"m_{'full' if full_logits else 'last'}.{backend}")
    if backend == "pte":
        dec = load_pte(export_pte(model, path, prefill_chunk=chunk, full_logits=full_logits))
    else:
        dec = load_onnx(export_onnx(model, path, prefill_chunk=chunk, full_logits=full_logits)["decode"])
    print(f"exported {backend}, full_logits={full_logits}: {time.perf_counter() - t:.0f} s", flush=True)
    return dec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench", help="bench, builtin or a checkpoint directory")
    ap.add_argument("--backend", default="compiled", choices=["compiled", "pte", "onnx"])
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk")
    ap.add_argument("--rounds", type=int, default=4, help="prefills of each kind, alternating")
    args = ap.parse_args()
    from shram_static import StaticDecoder
    from shram_static.bench import build_model

    model = build_model(args.model).eval()
    with tempfile.TemporaryDirectory(prefix="prefill_last_") as tmp:
        if args.backend == "compiled":
            dec = StaticDecoder(model, batch_size=1, prefill_chunk=args.chunk, compile=True)
            # full: every chunk's logits, the last token's picked here; last: the last-token step
            run = {False: lambda ids: dec.prefill(ids)[:, -1], True: lambda ids: dec.prefill(ids, last_only=True)}
            decs = {False: dec, True: dec}
        else:
            decs = {full: exported(model, args.backend, args.chunk, tmp, full) for full in (True, False)}
            decs = {False: decs[True], True: decs[False]}  # keyed by "last token's logits only"
            run = {k: (lambda d: lambda ids: d.prefill(ids, last_only=True))(d) for k, d in decs.items()}
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        for last_only in (False, True):  # the first call of each compiles its step or warms the runtime
            t = time.perf_counter()
            decs[last_only].reset()
            run[last_only](ids[:, :args.chunk])
            print(f"warm-up, last token only={last_only}: {time.perf_counter() - t:.1f} s")
        times, logits = {False: [], True: []}, {}
        for r in range(args.rounds):
            for last_only in ((True, False) if r % 2 else (False, True)):
                decs[last_only].reset()
                t = time.perf_counter()
                logits[last_only] = run[last_only](ids)
                times[last_only].append(time.perf_counter() - t)
        torch.testing.assert_close(logits[False], logits[True], atol=1e-4, rtol=1e-4)
    full, last = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}, {args.backend}, {args.tokens} tokens in chunks of {args.chunk}: every token's logits "
          f"{args.tokens / full:.0f} tok/s, last token's only {args.tokens / last:.0f} tok/s ({full / last:.2f}x)")


if __name__ == "__main__":
    main()
