"""Decode speed of the web site in headless Chromium and Node against Python's `load_onnx`, in one run.

For each model and weights (fp32, int8, int4) this exports the site once (`export_web`, kept
under --out), serves it on 127.0.0.1 (a plain static server: the page's coi-serviceworker makes
it cross-origin isolated, as on any static host), and measures round by round, in alternating
order: Python `load_onnx(threads=1)` on the site's own graphs, the page with one WASM thread, the
page with --threads WASM threads, and the site's module under Node (onnxruntime-web WASM and
onnxruntime-node, one thread). Each measures decode tokens/s of greedy decoding (prefill
excluded; the prompt goes through the prefill graph): Python as (t(N tokens) - t(1 token)) /
(N - 1), the others as `generate`'s own decodeTokensPerSecond (first token to last). Reports
medians and each one's ratio to Python.

"first" is the first generation after the page loaded (the page warms up while it loads:
`ShramModel.warmUp`, its time reported as "warm-up s"); "cold" pages (?warmup=0) show what a
page without the warm-up gives. --warmup-s more seconds of generation per runner precede the
rounds.

    python benchmarks/web_speed.py --models builtin,bench --weights fp32,int4 [--tokens 128] [--rounds 5] [--threads 2]

Needs `npm ci` (onnxruntime-web, playwright-core, coi-serviceworker) and Debian's chromium
(CHROMIUM overrides /usr/bin/chromium). A busy core halves WASM: run it on an idle machine.
"""

import argparse
import functools
import http.server
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(root: Path) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def site_for(name: str, weights: str, out: Path, prefill_chunk: int) -> Path:
    """The model's site under `out`, exported unless one is there (delete it after changing the
    exporter or the model); its page, module and service worker are refreshed from the package."""
    from shram_static.bench import build_model
    from shram_static.export.web import COI_FILE, PAGE_FILES, WEB_DIR, export_web, find_ort_web
    from shram_static.tokenizer import ByteTokenizer
    site = out / f"{name}-{weights}"
    if not (site / "shram.json").is_file():
        print(f"exporting {name} ({weights}) into {site} ...", file=sys.stderr)
        export_web(build_model(name), ByteTokenizer(), str(site), prefill_chunk=prefill_chunk,
                   quantize=None if weights == "fp32" else weights)
    for f in PAGE_FILES:  # the page and module as they are now (the graphs stay)
        shutil.copyfile(WEB_DIR / f, site / f)
    shutil.copyfile(find_ort_web().parent.parent / "coi-serviceworker" / COI_FILE, site / COI_FILE)
    return site


class LineWorker:
    """A node script that takes one JSON job per stdin line and answers one JSON line each."""

    def __init__(self, argv: list, what: str):
        self.what = what
        self.p = subprocess.Popen(["node", *argv], cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, job: dict) -> dict:
        self.p.stdin.write(json.dumps(job) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.what} ended early (see its stderr above)")
        r = json.loads(line)
        if "error" in r:
            raise RuntimeError(f"{self.what}: {r['error']}; page log: {r.get('logs')}")
        return r

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


class NodeWorker(LineWorker):
    """benchmarks/web_node_worker.mjs: the site's module under Node, one job per line."""

    def __init__(self, runtime: str, site: Path):
        super().__init__([str(ROOT / "benchmarks" / "web_node_worker.mjs"), runtime, str(site)], "node worker")

    def run(self, ids: list, n: int) -> dict:
        return self.ask({"prompt": ids, "options": {"maxNewTokens": n, "eosTokenId": None}})


class Browser(LineWorker):
    """web/browser.mjs --stdin: one Chromium, one page per URL, one job per line."""

    def __init__(self):
        super().__init__([str(ROOT / "web" / "browser.mjs"), "--stdin"], "web/browser.mjs")

    def run(self, url: str, ids: list, n: int) -> dict:
        return self.ask({"url": url, "prompt": ids, "options": {"maxNewTokens": n, "eosTokenId": None}})


def python_rate(dec, ids: torch.Tensor, n: int) -> float:
    """Decode tokens/s of `dec.generate` (prefill excluded by subtracting a 1-token run)."""
    t0 = time.perf_counter()
    dec.generate(ids, max_new_tokens=1, eos_token_id=-1)
    t1 = time.perf_counter()
    dec.generate(ids, max_new_tokens=n, eos_token_id=-1)
    t2 = time.perf_counter()
    return (n - 1) / ((t2 - t1) - (t1 - t0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="builtin,bench", help="comma-separated: builtin, bench, or checkpoint dirs")
    p.add_argument("--weights", default="fp32,int4", help="comma-separated: fp32, int8, int4")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per measured run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="WASM threads of the second page (0: skip it)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="seconds each runner generates before the rounds")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="also a page without the warm-up (?warmup=0): its first generation")
    p.add_argument("--node", action=argparse.BooleanOptionalAction, default=True,
                   help="also the module under Node (onnxruntime-web WASM and onnxruntime-node)")
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "out" / "web_speed"), help="where the sites are kept")
    args = p.parse_args(argv)
    from shram_static.export import load_onnx
    from shram_static.tokenizer import ByteTokenizer

    out = Path(args.out)
    variants = [(m.strip(), w.strip()) for m in args.models.split(",") if m.strip()
                for w in args.weights.split(",") if w.strip()]
    sites = {v: site_for(*v, out, args.prefill_chunk) for v in variants}
    prompt = ByteTokenizer().encode("ROMEO:")
    server = serve(out)
    browser = Browser()
    results = []
    try:
        for v in variants:
            site = sites[v]
            base = f"http://127.0.0.1:{server.server_address[1]}/{site.relative_to(out).as_posix()}/index.html"
            urls = {"web-1t": f"{base}?threads=1"}
            if args.threads:
                urls[f"web-{args.threads}t"] = f"{base}?threads={args.threads}"
            workers = ({"node-wasm-1t": NodeWorker("web", site), "node-native-1t": NodeWorker("node", site)}
                       if args.node else {})
            runners = {k: functools.partial(browser.run, u) for k, u in urls.items()}
            runners.update({k: w.run for k, w in workers.items()})
            dec = load_onnx(str(site / "model.onnx"), threads=1)
            ids = torch.tensor([prompt])
            python_rate(dec, ids, 16)  # warm-up
            first = {k: run(prompt, args.tokens) for k, run in runners.items()}  # load (+ the page's warm-up)
            if args.cold:  # a page without the warm-up: its first generation
                first["web-1t-cold"] = browser.run(f"{base}?threads=1&warmup=0", prompt, args.tokens)
            info = {k: r["info"] for k, r in first.items() if "info" in r}
            for k, run in runners.items():
                t = time.perf_counter()
                while time.perf_counter() - t < args.warmup_s:
                    run(prompt, args.tokens)
            rates = {"python-1t": [], **{k: [] for k in runners}}
            for r in range(args.rounds):
                order = list(rates) if r % 2 == 0 else list(reversed(rates))
                for k in order:
                    rate = (python_rate(dec, ids, args.tokens) if k == "python-1t"
                            else runners[k](prompt, args.tokens)["decodeTokensPerSecond"])
                    rates[k].append(rate)
            med = {k: statistics.median(v) for k, v in rates.items()}
            files = json.loads((site / "shram.json").read_text())["files"]
            row = {"model": v[0], "weights": v[1], "tokens": args.tokens, "rounds": args.rounds,
                   "model_bytes": sum((site / f).stat().st_size for f in files.values()),
                   "tokens_per_s": {k: round(x, 1) for k, x in med.items()},
                   "ratio_to_python": {k: round(x / med["python-1t"], 3) for k, x in med.items() if k != "python-1t"},
                   "first_tokens_per_s": {k: round(r["decodeTokensPerSecond"], 1) for k, r in first.items()},
                   "first_ratio_to_python": {k: round(r["decodeTokensPerSecond"] / med["python-1t"], 3)
                                             for k, r in first.items()},
                   "ttft_ms": {k: round(r["ttftMs"], 1) for k, r in first.items()},
                   "load_s": {k: round(i["loadMs"] / 1000, 2) for k, i in info.items()},
                   "warmup_s": {k: round(i["warmUp"]["ms"] / 1000, 2) for k, i in info.items() if i.get("warmUp")},
                   "spread": {k: [round(min(x), 1), round(max(x), 1)] for k, x in rates.items()},
                   "chromium": info["web-1t"]["browser"],
                   "onnxruntime_web": info["web-1t"]["manifest"]["onnxruntime_web"],
                   "threads": {k: i["threads"] for k, i in info.items()},
                   "isolated": {k: i["crossOriginIsolated"] for k, i in info.items()}}
            results.append(row)
            print(f"{v[0]} {v[1]} ({row['model_bytes'] / 1e6:.1f} MB): "
                  + ", ".join(f"{k} {x:.1f} tok/s" for k, x in med.items()) + " | ratio "
                  + ", ".join(f"{k} {x:.2f}x" for k, x in row["ratio_to_python"].items())
                  + " | first generation after load " + ", ".join(f"{k} {x:.2f}x" for k, x in row["first_ratio_to_python"].items())
                  + " | warm-up s " + ", ".join(f"{k} {x}" for k, x in row["warmup_s"].items()), flush=True)
            del dec
            for w in workers.values():
                w.close()
    finally:
        browser.close()
        server.shutdown()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
