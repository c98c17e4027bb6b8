"""Two checkouts of the package against each other: a compiled decoder of each, in a worker
process of its own, timed in turn round by round (the order reversed every round).

What a change to the host code or the compiled step costs when no switch turns it off (a
commit against its parent, each checked out with `git worktree add`). Per round each worker
times 5 prefills of 64 tokens (`--context`), then 12 decode steps and 6 verify steps of 5 tokens
(each rolled back), then one `generate` (400 tokens on the built-in model, 40 on the bench model).
Prints each figure's medians and new/old (above 1: the new checkout is slower).

    python benchmarks/tree_ab.py OLD_DIR NEW_DIR [--model bench] [--rounds 8] [--quantize int8|int4]
        [--new-options '{"cpp_wrapper": true}'] [--context 800] [--new-python VENV/bin/python]

`--new-python` runs the new side in another interpreter (another torch, in a venv of its own).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PREFILLS = 5  # timed prefills a round (their median)


def worker(model_name: str, quantize: str = "", options: str = "{}", context: str = "64") -> None:
    """The child: builds the decoder, says its warm-up, then times one round per stdin line."""
    import torch

    from shram_static import StaticDecoder
    from shram_static.bench import build_model
    torch.manual_seed(0)
    m = build_model(model_name).eval()
    # WHY quantize only when asked: an older checkout's decoder may not take it
    dec = StaticDecoder(m, batch_size=1, prefill_chunk=32, compile=True, **({"quantize": quantize} if quantize else {}),
                        **({"options": json.loads(options)} if options != "{}" else {}))
    N = int(context)
    ids = torch.randint(0, m.config.vocab_size, (1, max(512, N + 8)), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    dec.prefill(ids[:, :N], last_only=True)
    dec.decode(ids[:, 0])
    dec.verify(ids[:, :5])
    dec.rollback(5)
    dec.generate(ids[:, :8], max_new_tokens=4)
    print(json.dumps({"warmup_s": time.perf_counter() - t}), flush=True)
    for _ in sys.stdin:
        # WHY several prefills: one a round spreads so widely that the same tree on both sides
        # read as a prefill change (docs/performance.md, "Host cost of the compiled step")
        prefills = []
        for _ in range(PREFILLS):
            dec.reset()
            t = time.perf_counter()
            dec.prefill(ids[:, :N], last_only=True)
            prefills.append(time.perf_counter() - t)
        got = {"prefill": statistics.median(prefills), "decode": [], "verify": []}
        for i in range(12):
            t = time.perf_counter()
            dec.decode(ids[:, 100 + i])
            got["decode"].append(time.perf_counter() - t)
        for i in range(6):
            t = time.perf_counter()
            dec.verify(ids[:, 200 + i:205 + i])
            got["verify"].append(time.perf_counter() - t)
            dec.rollback(5)
        n = 400 if model_name == "builtin" else 40
        t = time.perf_counter()
        dec.generate(ids[:, :40], max_new_tokens=n)
        got["generate"] = time.perf_counter() - t
        got["decode"], got["verify"] = statistics.median(got["decode"]), statistics.median(got["verify"])
        print(json.dumps(got), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quantize", choices=["int8", "int4"], default="", help="the compiled-int8 / -int4 layers")
    ap.add_argument("--new-options", default="{}", help="JSON: Inductor options of the new side's decoder")
    ap.add_argument("--context", type=int, default=64, help="tokens prefilled before the decode and verify steps")
    ap.add_argument("--new-python", default=sys.executable, help="the new side's interpreter (default: this one)")
    args = ap.parse_args(argv)
    ws = {}
    for side, tree in (("old", args.old), ("new", args.new)):
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        python = args.new_python if side == "new" else sys.executable
        ws[side] = subprocess.Popen([python, os.path.abspath(__file__), "--worker", args.model,
                                     args.quantize, args.new_options if side == "new" else "{}", str(args.context)],
                                    env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        print(side, "warm-up", json.loads(ws[side].stdout.readline()), flush=True)
    got = {s: [] for s in ws}
    for r in range(args.rounds):
        for s in (("old", "new") if r % 2 == 0 else ("new", "old")):
            ws[s].stdin.write("go\n")
            ws[s].stdin.flush()
            got[s].append(json.loads(ws[s].stdout.readline()))
    for k in ("decode", "verify", "prefill", "generate"):
        o, n = (statistics.median(x[k] for x in got[s]) for s in ("old", "new"))
        print(f"{args.model} compiled{'-' * bool(args.quantize)}{args.quantize} B=1 {k}: old {o * 1e3:.3f} ms, new {n * 1e3:.3f} ms, new/old {n / o:.3f}")
    for w in ws.values():
        w.stdin.close()
        w.wait()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
    else:
        raise SystemExit(main())
