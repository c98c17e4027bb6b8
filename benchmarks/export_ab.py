"""Export time with accelerators off against on, each export in a process of its own, in turn.

`shram-static bench` times one export per artifact; this times the same export (`bench.export_one`)
of one model and backend once per `SHRAM_STATIC_STOCK` value given, the order reversed every
round, and prints each side's median and its ratio to the first (the accelerated side, all on).
What backs the export-time rows of the accelerator table in docs/performance.md.

    python benchmarks/export_ab.py --model bench --backend pte one_trace_lowering 1
    python benchmarks/export_ab.py --model bench --backend onnx skip_onnx_slices_split --rounds 2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CODE = ("import json, sys; from shram_static.bench import export_one; "
        "print(json.dumps(export_one(sys.argv[1], sys.argv[2], 1, 32, sys.argv[3])))")


def export_s(model: str, backend: str, stock: str) -> float:
    """One export in a fresh process with SHRAM_STATIC_STOCK=stock; its export_s."""
    with tempfile.TemporaryDirectory(prefix="export_ab_") as out:
        env = {**os.environ, "SHRAM_STATIC_STOCK": stock}
        r = subprocess.run([sys.executable, "-c", CODE, model, backend, out], env=env, check=True,
                           capture_output=True, text=True)
        return json.loads(r.stdout.strip().splitlines()[-1])["export_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stock", nargs="+", help="SHRAM_STATIC_STOCK of each stock side: 1 (all) or names")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--backend", default="pte")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    sides = ["", *args.stock]
    got = {s: [] for s in sides}
    for r in range(args.rounds):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            got[s].append(export_s(args.model, args.backend, s))
            print(f"  {s or 'accelerated'}: {got[s][-1]:.1f} s", flush=True)
    base = statistics.median(got[""])
    for s in sides:
        m = statistics.median(got[s])
        print(f"{args.model} {args.backend} export, SHRAM_STATIC_STOCK={s!r}: {m:.1f} s "
              f"({m / base:.2f}x the accelerated export)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
