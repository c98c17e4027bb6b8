"""What a decoder's host code costs per call, without the step itself.

A small model's step is a millisecond or two, so the Python around it (input checks, padding,
the logits check, bookkeeping) is a visible share of decoding. This builds a `StaticDecoder`,
replaces its `_run` by one that returns fixed logits, and times each host path with `timeit`
(best of 5 repeats): the public `decode` / `verify` / `rollback`, which check their inputs, and
`_feed` / `_forget`, which `generate`'s loops use for tokens they picked themselves. Then it
times `_run` itself (the compiled step with its guards skipped) for scale, also inside a
`_steady` window (what `generate` runs without a streamer: each step checked once), and 400
greedy tokens of `generate` against a decoder that checks every step.

`--in-situ` measures the same host code between real steps instead. A step streams every
weight through the caches, so the host code after it runs on cold caches and costs several
times its hot cost above. The Inductor kernels of the compiled step are timed from inside (each
wrapped in a timer), and each loop's time without them is its host code: the public `decode`,
`_run` (its checks and the frame), the compiled frame code alone (Dynamo's bytecode that
fetches every weight and state tensor, the wrapper around the kernels) and `_run` in a `_steady`
window (no checks), each in its own interleaved round.

    python benchmarks/host_costs.py [--model builtin|bench|DIR] [--calls 2000] [--rounds 10] [--in-situ]
"""

import argparse
import contextlib
import statistics
import time
import timeit

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10, help="generate runs per side (--in-situ: rounds per loop)")
    ap.add_argument("--in-situ", action="store_true", help="host code between real steps (see above)")
    args = ap.parse_args(argv)

    from shram_static import StaticDecoder
    from shram_static.bench import build_model

    model = build_model(args.model).eval()
    dec = StaticDecoder(model, batch_size=1, compile=True)
    V, n = model.config.vocab_size, dec.verify_len
    ids = torch.randint(0, V, (1, 300), generator=torch.Generator().manual_seed(0))
    dec.prefill(ids[:, :256])
    dec.verify(ids[:, :n])  # compile both steps before timing
    dec.rollback(n)
    dec.decode(ids[:, 0])
    dec.rollback(1)
    v, v1 = ids[:, :n], ids[:, :1].clone()
    live_v, live_1 = torch.ones(1, n, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool)

    env = dict(dec=dec, v=v, v1=v1, live_v=live_v, live_1=live_1, two=torch.tensor([2]))
    if args.in_situ:
        steps = 50
        print(f"{args.model}: decode step in a loop of real steps, median of {args.rounds} interleaved "
              f"rounds of {steps}")
        for name, (total, host) in in_situ(dec, v1, live_1, args.rounds, steps).items():
            print(f"  {name:<28} {total:7.3f} ms per step, {host:6.3f} ms ({host / total:5.1%}) outside the kernels")
        return 0

    def us(stmt: str) -> float:
        """Best-of-5 microseconds per call of stmt (each statement puts the counts back)."""
        return min(timeit.repeat(stmt, number=args.calls, repeat=5, globals=env)) / args.calls * 1e6

    run = dec._run
    logits = {n: torch.randn(1, n, V), 1: torch.randn(1, 1, V)}
    dec._run = lambda tokens, input_pos, live: logits[tokens.shape[1]]
    undo = "dec._count -= {k}; dec._undo -= {k}"
    rows = [
        ("decode (checked)", us("dec.decode(v[:, 0]); " + undo.format(k=1))),
        ("_feed, 1 token", us("dec._feed(v1, live_1); " + undo.format(k=1))),
        (f"verify of {n} (checked)", us("dec.verify(v); " + undo.format(k=n))),
        (f"_feed, {n} tokens", us("dec._feed(v, live_v); " + undo.format(k=n))),
        ("rollback of 2 (checked)", us("dec._count += 2; dec._undo += 2; dec.rollback(two)")),
        ("_forget of 2", us("dec._count += 2; dec._undo += 2; dec._forget(two)")),
    ]
    dec._run = run
    env["pos"] = dec._count.clone()
    rows.append((f"_run, the compiled verify step of {n}", us("dec._run(v, pos, live_v)")))
    rows.append(("_run, the compiled decode step", us("dec._run(v1, pos, live_1)")))
    with dec._steady():  # generate's loops without a streamer: each step checked once
        dec._run(v, env["pos"], live_v)
        dec._run(v1, env["pos"], live_1)
        rows.append((f"_run, verify of {n}, steady", us("dec._run(v, pos, live_v)")))
        rows.append(("_run, decode, steady", us("dec._run(v1, pos, live_1)")))
    # 400 greedy tokens through generate, steady against every step checked, alternating
    prompt, plain = ids[:, :8], {"steady": [], "checked": []}
    checked = StaticDecoder(model, batch_size=1, compile=True)
    checked._steady = lambda on=True: contextlib.nullcontext()
    for d in (dec, checked):
        d.generate(prompt, max_new_tokens=400)
    for r in range(args.rounds):
        for name, d in (("steady", dec), ("checked", checked))[::1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            d.generate(prompt, max_new_tokens=400)
            plain[name].append(time.perf_counter() - t0)
    print(f"{args.model}: host cost per call, the step replaced by fixed logits (best of 5 x {args.calls})")
    for name, t in rows:
        print(f"  {name:<40} {t:8.1f} us")
    a, b = statistics.median(plain["steady"]), statistics.median(plain["checked"])
    print(f"generate, 400 greedy tokens (median of {args.rounds} alternating): steady {a * 1e3:.1f} ms, "
          f"every step checked {b * 1e3:.1f} ms: {a / b:.3f}x")
    return 0


def in_situ(dec, v1, live_1, rounds: int, steps: int = 50) -> dict:
    """The decode step's time in loops of real steps, split into its Inductor kernels and the
    rest, for each way of calling it (see the module docstring).

    Args:
        dec: a compiled `StaticDecoder` of batch 1 whose decode step has run.
        v1, live_1: (1, 1) token and live mask to decode (at the same position each time).
        rounds: interleaved rounds per loop; steps: steps per round.

    Returns:
        {loop name: (median ms per step, median ms of it outside the kernels)}.
    """
    import types

    from torch._inductor.codecache import PyCodeCache

    spent = [0]

    def timed(kernel):
        def run(*a):
            t = time.perf_counter_ns()
            try:
                return kernel(*a)
            finally:
                spent[0] += time.perf_counter_ns() - t
        return run

    # WHY Inductor's private module cache: the kernels are its generated C++ functions, named
    # cpp_fused_* in the wrapper modules it loaded; each is put back after the measurement.
    wrapped = [(mod, name, fn) for mod in PyCodeCache.modules for name, fn in list(vars(mod).items())
               if name.startswith("cpp_fused") and isinstance(fn, types.BuiltinFunctionType)]
    if not wrapped:
        raise RuntimeError("no Inductor kernels found to time (another torch release?)")
    pos, frame = dec._count.clone(), dec._frames.get("decode")
    ids = v1[:, 0]

    def decode():
        dec.decode(ids)
        dec._count -= 1
        dec._undo -= 1

    def run():
        dec._run(v1, pos, live_1)

    # each loop: its step and the window the steps run in (`_steady`: each step checked once)
    plain = contextlib.nullcontext
    loops = {"decode (public, checked)": (decode, plain), "_run (checks + frame)": (run, plain)}
    if frame is not None:
        loops["frame code alone"] = (lambda: frame(v1, pos, live_1), plain)
    loops["_run in a _steady window"] = (run, dec._steady)
    times = {k: [] for k in loops}
    for mod, name, fn in wrapped:
        setattr(mod, name, timed(fn))
    try:
        for r in range(rounds):
            for name in list(loops)[::1 if r % 2 == 0 else -1]:
                spent[0] = 0
                t = time.perf_counter_ns()
                step, window = loops[name]
                with window():
                    for _ in range(steps):
                        step()
                total = (time.perf_counter_ns() - t) / steps / 1e6
                times[name].append((total, total - spent[0] / steps / 1e6))
    finally:
        for mod, name, fn in wrapped:
            setattr(mod, name, fn)
    return {name: (statistics.median(t for t, _ in ts), statistics.median(h for _, h in ts))
            for name, ts in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
