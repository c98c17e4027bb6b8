"""How many steps speculative greedy decoding with prompt lookup takes, per lookup setting.

Greedy output does not depend on the guesses, so the steps a setting needs can be counted
without timing a model: this decodes each prompt's greedy continuation once (eager, the
built-in model or `--model`), then replays `speculative.speculative_generate` itself (drafts,
gate, acceptance) against a scripted decoder whose logits put the argmax on the recorded token
at each position. It prints, per prompt and setting, the verify and decode steps and the
speedup over plain decoding they give at a verify step of `--verify-cost` decode steps
(measured by `shram-static bench-speculative`; docs/performance.md, "Speculative decoding").

It ends with what choosing each round's guesses perfectly would reach: an oracle that knows,
before each round, how many of prompt lookup's guesses the target will keep, verifies exactly
those (a verify step of w tokens costing 1 + (verify cost - 1) (w - 1) / k decode steps, the
cost growing linearly with the tokens) and decodes plainly when none would be kept.

    python benchmarks/prompt_lookup.py [--model builtin|DIR] [--tokens 400] [--verify-cost 1.55] [--speculate 4]
        [--gate-cost 1.65]
"""

import argparse
import contextlib
import math
import sys
from unittest import mock

import torch

# Beyond the two prompts of `shram-static bench-speculative`: held-out ones of both kinds.
HAMLET = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
          "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n"
          "And by opposing end them. To die: to sleep;\nNo more; and by a sleep to say we end\n"
          "The heart-ache and the thousand natural shocks\nThat flesh is heir to, 'tis a consummation\n")
LEAR = ("Blow, winds, and crack your cheeks! rage! blow!\nYou cataracts and hurricanoes, spout\n"
        "Till you have drench'd our steeples, drown'd the cocks!\nYou sulphurous and thought-executing fires,\n")
EXTRA = {"hamlet (grounded)": HAMLET + "\n" + HAMLET[:80], "lear (grounded)": LEAR + "\n" + LEAR[:60],
         "summary (grounded)": HAMLET + "\nIn short, Hamlet asks whether", "JULIET: (free)": "JULIET:",
         "KING HENRY: (free)": "KING HENRY:\n", "ACT I. SCENE (free)": "ACT I. SCENE"}
# (max_ngram, min_ngram, probe_every): the package's setting first, then alternatives
SETTINGS = [None, (3, 1, 8), (8, 1, 8), (3, 2, 8), (3, 1, 2), (8, 2, 8), (8, 2, 4), (12, 2, 2), (16, 2, 2),
            (8, 3, 2), (8, 4, 2), (8, 3, 1), (8, 2, 1)]


class Scripted:
    """A batch-1 `HostDecoder` stand-in whose logits after position t pick `seq[t + 1]`."""

    def __init__(self, seq: list[int], vocab: int, verify_len: int = 5):
        self.seq, self.V = seq, vocab
        self.batch_size, self.verify_len, self.prefill_chunk, self.rollback_limit = 1, verify_len, 32, verify_len
        self.n = 0  # tokens fed

    def _logits(self, n_fed: int) -> torch.Tensor:
        out = torch.zeros(n_fed, self.V)
        for i in range(n_fed):
            t = self.n - n_fed + i + 1  # the position each fed token's logits predict
            out[i, self.seq[t] if t < len(self.seq) else 0] = 1.0
        return out

    def reset(self):
        self.n = 0

    def prefill(self, ids, live, last_only=False):
        self.n += int(live.sum())
        return self._logits(1)

    def feed(self, ids, live):  # what the loop calls for a decode or verify step
        k = int(live.sum())
        self.n += k
        return self._logits(k)[None]

    def forget(self, n):  # and for a rollback
        self.n -= int(n.sum())

    def steady(self, on=True):  # nothing to check between its steps
        return contextlib.nullcontext()


def steps(prompt: list[int], new: list[int], vocab: int, setting, k: int = 4, gate: float | None = None) -> dict:
    """speculative_generate's stats replaying `new` after `prompt` with a lookup setting, at
    most k guesses per verify step (of k + 1 tokens), and the gate's verify cost (None: the package's)."""
    from shram_static.sampling import Sampler

    from shram_static import speculative
    dec = Scripted(prompt + new, vocab, verify_len=k + 1)
    ids = torch.tensor([prompt])
    st = {}
    patches = [] if gate is None else [mock.patch.object(speculative, "VERIFY_COST", gate)]
    if setting is not None:
        mx, mn, probe = setting
        patches += [mock.patch.object(speculative, "PROBE_EVERY", probe),
                    mock.patch.object(speculative, "LOOKUP_NGRAMS", (mx, mn))]
    for p in patches:
        p.start()
    try:
        out = speculative.speculative_generate(dec, ids, torch.ones_like(ids, dtype=torch.bool), len(new), False,
                                               Sampler(0), None, None, 0, None, k, stats=st)
    finally:
        for p in patches:
            p.stop()
    assert out[0].tolist() == new, "the replay must emit the recorded greedy tokens"
    return st


def oracle_cost(prompt: list[int], new: list[int], verify_cost: float, k: int = 4) -> tuple[float, int, int]:
    """(decode-step equivalents, verify steps, decode steps) for `new` after `prompt` when each
    round verifies exactly the guesses of the package's lookup that the target keeps (see the
    module docstring)."""
    from shram_static.speculative import LOOKUP_NGRAMS, PromptLookup

    lk = PromptLookup(*LOOKUP_NGRAMS)
    lk.extend(prompt + new[:1])
    t, cost, rounds, decodes = 1, 0.0, 0, 0
    while t < len(new):
        guess = lk.propose(min(k, len(new) - t - 1))
        a = 0  # guesses the target keeps: those equal to its greedy tokens
        while a < len(guess) and guess[a] == new[t + a]:
            a += 1
        if a:
            cost, rounds = cost + 1 + (verify_cost - 1) * a / k, rounds + 1
        else:
            cost, decodes = cost + 1, decodes + 1
        lk.extend(new[t:t + a + 1])
        t += a + 1
    return cost, rounds, decodes


def main(argv=None) -> int:
    from shram_static.console import positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--tokens", type=positive_int, default=400)
    ap.add_argument("--verify-cost", type=float, default=1.55, help="a verify step's cost in decode steps")
    ap.add_argument("--speculate", type=positive_int, default=4, help="k, the most guesses per verify step")
    ap.add_argument("--gate-cost", type=float, help="the gate's verify cost (speculative.VERIFY_COST) in the "
                    "replays; default the package's")
    args = ap.parse_args(argv)
    from shram_static import StaticDecoder
    from shram_static.bench import build_model
    from shram_static.bench.speculative import PROMPTS
    from shram_static.speculative import LOOKUP_NGRAMS, PROBE_EVERY
    from shram_static.tokenizer import ByteTokenizer

    model = build_model(args.model).eval()
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=32)
    tok = ByteTokenizer()
    prompts = {f"{k} (bench-speculative)": v for k, v in PROMPTS.items()} | EXTRA
    runs = {}
    for name, text in prompts.items():
        ids = torch.tensor([tok.encode(text)])
        runs[name] = (ids[0].tolist(), dec.generate(ids, max_new_tokens=args.tokens)[0].tolist())
        print(f"decoded {name}", file=sys.stderr)
    current = LOOKUP_NGRAMS + (PROBE_EVERY,)
    for setting in SETTINGS:
        label = f"max_ngram, min_ngram, probe_every = {setting or current}" + (" (the package's)" if setting is None else "")
        print(label)
        logs = []
        for name, (p, g) in runs.items():
            st = steps(p, g, model.config.vocab_size, setting, args.speculate, args.gate_cost)
            x = (len(g) - 1) / (st["decodes"] + args.verify_cost * st["rounds"])
            logs.append(math.log(x))
            print(f"  {name:32s} verify {st['rounds']:3d}  decode {st['decodes']:3d}  -> {x:.2f}x plain")
        print(f"  geometric mean {math.exp(sum(logs) / len(logs)):.3f}x")
    print("an oracle verifying exactly the guesses each round keeps")
    logs = []
    for name, (p, g) in runs.items():
        cost, rounds, decodes = oracle_cost(p, g, args.verify_cost, args.speculate)
        logs.append(math.log((len(g) - 1) / cost))
        print(f"  {name:32s} verify {rounds:3d}  decode {decodes:3d}  -> {(len(g) - 1) / cost:.2f}x plain")
    print(f"  geometric mean {math.exp(sum(logs) / len(logs)):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
