"""`shram-static bench-speculative`: at batch 1, a verify step against a decode step, then plain against
speculative greedy decoding with prompt lookup, interleaved (docs/performance.md, "Speculative decoding")."""

import contextlib
import statistics
import time

from ..console import info

# The opening of Shakespeare's Sonnet 18 (public domain): the passage of the grounded prompt.
PASSAGE = ("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
           "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n"
           "Sometime too hot the eye of heaven shines,\nAnd often is his gold complexion dimm'd;\n"
           "And every fair from fair sometime declines,\nBy chance or nature's changing course untrimm'd;\n"
           "But thy eternal summer shall not fade,\nNor lose possession of that fair thou ow'st;\n")
PROMPTS = {"grounded": PASSAGE + "\n" + PASSAGE[:80], "free": "ROMEO:"}


@contextlib.contextmanager
def timed_feeds(dec, clock=time.perf_counter):
    """Within the block, records every `dec.feed` as (tokens per row, seconds); yields the list. Nests.

    Args:
        dec: a `HostDecoder` (its `feed` is wrapped on the instance for the block).
        clock: a function giving seconds.
    """
    times: list[tuple[int, float]] = []
    had, feed = "feed" in vars(dec), dec.feed

    def timed(ids, live):
        t0 = clock()
        out = feed(ids, live)
        times.append((ids.shape[1], clock() - t0))
        return out

    dec.feed = timed
    try:
        yield times
    finally:
        if had:
            dec.feed = feed
        else:
            del dec.feed


def step_costs(dec, k: int, ctx: int, steps: int, clock=time.perf_counter) -> dict:
    """Median seconds of decode and verify steps (k + 1 tokens) at context ctx, alternating, rolled back."""
    import torch

    from ..speculative import steady

    V = dec.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    dec.reset()
    dec.prefill(torch.randint(0, V, (1, ctx), generator=gen), last_only=True)
    t = {name: [] for name in ("decode", "verify", "fed_decode", "fed_verify", "after_decode")}
    one, all_live = torch.ones(1, 1, dtype=torch.bool), torch.ones(1, k + 1, dtype=torch.bool)

    def timed(name: str, step, *args) -> None:
        t0 = clock()
        step(*args)
        t[name].append(clock() - t0)

    for _ in range(steps):
        ids = torch.randint(0, V, (1, k + 1), generator=gen)
        timed("decode", dec.decode, ids[:, 0])
        dec.rollback(1)
        timed("verify", dec.verify, ids)
        dec.rollback(k + 1)
        with steady([dec]):
            timed("fed_decode", dec.feed, ids[:, :1], one)
            dec.forget(torch.ones(1, dtype=torch.long))
            timed("fed_verify", dec.feed, ids, all_live)
            dec.forget(torch.full((1,), k + 1))
    for _ in range(steps):
        timed("after_decode", dec.decode, ids[:, 0])
        dec.rollback(1)
    return {name: statistics.median(v) for name, v in t.items()}


def _split(feeds: list[tuple[int, float]], total: float) -> dict:
    """Mean seconds per decode step, per verify step, and the loop's own time per step."""
    one = [s for n, s in feeds if n == 1]
    wide = [s for n, s in feeds if n > 1]
    mean = lambda v: sum(v) / len(v) if v else float("nan")
    return {"decode": mean(one), "verify": mean(wide), "loop": (total - sum(one) - sum(wide)) / max(1, len(feeds))}


def run_prompt(dec, ids: "torch.Tensor", n: int, k: int, rounds: int, clock=time.perf_counter) -> dict:
    """Plain and speculative greedy generation of n tokens, alternating `rounds` times: tokens/s medians."""
    import torch

    from ..sampling import Sampler
    from ..speculative import speculative_generate, steady

    live = torch.ones_like(ids, dtype=torch.bool)
    plain_s, spec_s, stats = [], [], {}
    gens: dict[str, list] = {"plain": [], "spec": []}  # (seconds after the first token, `_split`)
    for _ in range(rounds):
        t0 = clock()
        with timed_feeds(dec, clock) as plain_feeds:
            want = dec.generate(ids, max_new_tokens=n)
        t1 = clock()
        with timed_feeds(dec, clock) as spec_feeds:
            got = speculative_generate(dec, ids, live, n, False, Sampler(0), None, None, 0, None, k,
                                       None, stats)  # what generate(speculate=k) runs, its step counts kept
        t2 = clock()
        with steady([dec]):  # the first token's time, apart (a streamer would unsteady a compiled decoder)
            dec.reset()
            dec.prefill(ids, last_only=True).argmax(-1)
        first = clock() - t2
        if not torch.equal(got, want):
            raise RuntimeError("speculative greedy tokens differ from plain greedy decoding's")
        plain_s.append(t1 - t0)
        spec_s.append(t2 - t1)
        gens["plain"].append((t1 - t0 - first, _split(plain_feeds, t1 - t0 - first)))
        gens["spec"].append((t2 - t1 - first, _split(spec_feeds, t2 - t1 - first)))
    p, s = statistics.median(plain_s), statistics.median(spec_s)
    mid = {side: sorted(runs, key=lambda r: r[0])[len(runs) // 2] for side, runs in gens.items()}
    pg, sg = (statistics.median(r[0] for r in gens[side]) for side in ("plain", "spec"))
    ks = stats["k"]
    return {"plain_tok_s": n / p, "spec_tok_s": n / s, "speedup": p / s,
            "plain_gen_tok_s": (n - 1) / pg, "spec_gen_tok_s": (n - 1) / sg, "gen_speedup": pg / sg,
            "verify_steps": stats["rounds"],
            "decode_steps": stats["decodes"], "kept_per_verify": stats["accepted"] / max(1, stats["rounds"]),
            "tokens_per_step": n / max(1, stats["rounds"] + stats["decodes"]),
            "k_mean": sum(ks) / max(1, len(ks)),
            **{f"{side}_{key}": v for side, (_, split) in mid.items() for key, v in split.items()}}


def bench_speculative(args) -> int:
    """The `bench-speculative` subcommand."""
    import torch

    from ..decoders import make_decoder
    from ..tokenizer import ByteTokenizer
    from .throughput import build_model

    model = build_model(args.model).eval()
    k = args.speculate
    if args.threads:
        torch.set_num_threads(args.threads)
    # CPU time of all the process's threads: no waiting for a core (one thread: spinning ones count)
    clock = time.process_time if args.cpu_time else time.perf_counter
    with contextlib.ExitStack() as stack:
        dec = make_decoder(model, args.backend, args.prefill_chunk, stack, verify_len=k + 1)
        info(f"{args.model} on {args.backend}, batch 1, k = {k}, prefill chunk {dec.prefill_chunk}: warming up ...")
        dec.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
        dec.generate(torch.tensor([[1, 2, 3, 1, 2]]), max_new_tokens=4, speculate=k)
        step_costs(dec, k, min(64, args.context), 3)
        c = step_costs(dec, k, args.context, args.steps, clock)
        print(f"{args.model} {args.backend}: decode step {c['decode'] * 1e3:.2f} ms, verify step of {k + 1} "
              f"tokens {c['verify'] * 1e3:.2f} ms: verify / decode = {c['verify'] / c['decode']:.2f} "
              f"(context {args.context}); as generate feeds them {c['fed_decode'] * 1e3:.2f} vs "
              f"{c['fed_verify'] * 1e3:.2f} ms = {c['fed_verify'] / c['fed_decode']:.2f}; a decode step "
              f"after a decode step {c['after_decode'] * 1e3:.2f} ms")
        if args.model == "bench" and not args.prompts:
            return 0
        tok = ByteTokenizer()
        for name in args.prompts or list(PROMPTS):
            ids = torch.tensor([tok.encode(PROMPTS[name])])
            r = run_prompt(dec, ids, args.max_new_tokens, k, args.rounds, clock)
            print(f"{name} ({ids.shape[1]} prompt tokens, {args.max_new_tokens} new): plain {r['plain_tok_s']:.0f} "
                  f"tok/s, speculative {r['spec_tok_s']:.0f} tok/s = {r['speedup']:.2f}x with the prompt's prefill; "
                  f"after the first token {r['plain_gen_tok_s']:.0f} vs {r['spec_gen_tok_s']:.0f} tok/s = "
                  f"{r['gen_speedup']:.2f}x; {r['verify_steps']} verify "
                  f"+ {r['decode_steps']} decode steps, {r['kept_per_verify']:.2f} guesses kept per verify, "
                  f"{r['tokens_per_step']:.2f} tokens per step, mean k {r['k_mean']:.2f}; inside the loops, "
                  f"plain: decode steps {r['plain_decode'] * 1e3:.3f} ms + {r['plain_loop'] * 1e3:.3f} ms "
                  f"around each; speculative: verify steps {r['spec_verify'] * 1e3:.3f} ms, decode steps "
                  f"{r['spec_decode'] * 1e3:.3f} ms, {r['spec_loop'] * 1e3:.3f} ms around each")
    return 0
