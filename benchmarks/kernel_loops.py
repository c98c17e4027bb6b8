"""Where a compiled step's C++ kernels spend their time, loop nest by loop nest.

`compiled_profile.py` times each Inductor kernel; with the router fused, a layer is one C++
kernel holding every loop of the layer (projections, attention, the MLP), so that view stops
at "the layer". This runs the compiled decode or verify step of `--model` in a loop in a child
process, samples it with `perf record`, maps each sample in an Inductor kernel to the line of
its generated C++ (`addr2line`, outermost inlined frame) and sums the samples per top-level loop
nest of the hottest kernels. Needs Linux `perf` and binutils' `addr2line`; Inductor's C++ is
built with line tables (`-g1`).

    python benchmarks/kernel_loops.py [--model builtin|bench|DIR] [--step decode|verify] [--seconds 10]

Each loop nest prints with its share of all samples (every thread), its line range in the
kernel's `.cpp` and its outer loop headers (their trip counts say which op it is: e.g. the
MLP's `x0 < mlp_width` rows, the sparse attention's `x0 < C * K` queries over `x1 < T + 1`
slots).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time


def loop(model_name: str, step: str, seconds: float) -> None:
    """Child: times 20 steps, prints "ready <ms per step>", then runs the step until `seconds`
    have passed."""
    import torch

    from shram_static import StaticDecoder
    from shram_static.bench import build_model

    model = build_model(model_name).eval()
    dec = StaticDecoder(model, batch_size=1, compile=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    dec.prefill(ids[:, :256])
    n = dec.verify_len if step == "verify" else 1
    tokens, live = ids[:, :n].clone(), torch.ones(1, n, dtype=torch.bool)
    back = torch.full((1,), n)

    def run():  # one step at the same position each time: fed, then forgotten
        dec.feed(tokens, live)
        dec.forget(back)
    for _ in range(10):  # compiles, then warms the caches
        run()
    t = time.perf_counter()
    for _ in range(20):
        run()
    print(f"ready {(time.perf_counter() - t) / 20 * 1e3:.2f}", flush=True)
    end = time.time() + seconds
    while time.time() < end:
        run()


def nests(src: list[str]) -> list[tuple[int, int, str]]:
    """Top-level loop nests of the kernel function in a generated .cpp: (first line, last line,
    outer loop headers), 1-based. Blocks open at 4 spaces; those inside an OpenMP parallel
    region one level deeper."""
    start = next(i for i, line in enumerate(src) if line.startswith('extern "C"'))

    def at(indent: str, lo: int, hi: int):
        out, cur = [], None
        for i in range(lo, hi):
            if src[i] == indent + "{":
                cur = [i + 1, i + 1, []]
                out.append(cur)
            if cur is not None:
                cur[1] = i + 1
                if len(cur[2]) < 2 and "for(" in src[i]:
                    head = re.sub(r"static_cast<int64_t>\((\w+)\)", r"\1", src[i].strip())
                    cur[2].append(re.sub(r"for\(int64_t (\w+)=0L; \1<(\w+); .*", r"\1 < \2", head))
        return out

    blocks = []
    for b in at(" " * 4, start, len(src)):
        parallel = "#pragma omp parallel" in src[b[0] - 2]
        blocks += at(" " * 8, b[0], b[1]) if parallel else [b]
    return [(a, b, ", ".join(h)) for a, b, h in blocks]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--step", choices=["decode", "verify"], default="verify")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--kernels", type=int, default=2, help="hottest Inductor kernels to break down")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        loop(args.model, args.step, args.seconds + 5)
        return 0
    child = subprocess.Popen([sys.executable, __file__, "--child", "--model", args.model, "--step", args.step,
                              "--seconds", str(args.seconds)], stdout=subprocess.PIPE, text=True)
    try:
        ready = child.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise SystemExit("the step loop did not start")
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "perf.data")
            subprocess.run(["perf", "record", "-F", "2000", "-p", str(child.pid), "-o", data, "--",
                            "sleep", str(args.seconds)], check=True, capture_output=True)
            script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym,symoff,dso"],
                                    capture_output=True, text=True).stdout
    finally:
        child.kill()
        child.wait()
    samples = collections.Counter()  # (dso, symbol, offset)
    for line in script.splitlines():
        m = re.match(r"\s*[0-9a-f]+\s+(\S+)\+0x([0-9a-f]+)\s+\((.*)\)", line)
        if m:
            samples[(m.group(3), m.group(1), int(m.group(2), 16))] += 1
    total = sum(samples.values())
    by_dso = collections.Counter()
    for (dso, _, _), c in samples.items():
        by_dso[dso] += c
    print(f"{args.model} {args.step} step: {ready[1]} ms (mean of 20 before sampling), {total} samples")
    for dso, c in by_dso.most_common(6):
        print(f"  {100 * c / total:5.1f}%  {os.path.basename(dso)}")
    kernels = [d for d, _ in by_dso.most_common() if d.endswith(".main.so")][:args.kernels]
    for so in kernels:
        cpp = so[:-3] + ".cpp"
        syms = {}
        for line in subprocess.run(["nm", so], capture_output=True, text=True).stdout.splitlines():
            parts = line.split()
            if len(parts) == 3:
                syms[parts[2]] = int(parts[0], 16)
        addrs = collections.Counter()
        for (dso, sym, off), c in samples.items():
            if dso == so and sym in syms:
                addrs[syms[sym] + off] += c
        out = subprocess.run(["addr2line", "-i", "-a", "-e", so, *[hex(a) for a in addrs]],
                             capture_output=True, text=True).stdout
        lines = collections.Counter()
        for block in re.split(r"^0x", out, flags=re.M)[1:]:
            rows = block.strip().splitlines()
            own = [r for r in rows[1:] if r.split(":")[0].endswith(".main.cpp")]
            if own:
                lines[int(own[-1].split(":")[1].split()[0])] += addrs[int(rows[0], 16)]
        src = open(cpp).read().splitlines()
        print(f"\n{os.path.basename(cpp)}: {100 * by_dso[so] / total:.1f}% of all samples")
        shares = [(sum(c for ln, c in lines.items() if a <= ln <= b), a, b, head) for a, b, head in nests(src)]
        for c, a, b, head in sorted(shares, reverse=True):
            if c / total >= 0.01:
                print(f"  {100 * c / total:5.1f}%  lines {a}-{b}: {head}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
