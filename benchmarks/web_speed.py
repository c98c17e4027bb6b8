"""Decode speed of the web site in headless Chromium against Python's `load_onnx`, in one run.

For each model this exports the site once (`export_web`, kept under --out), serves it on
127.0.0.1 twice (plainly, and cross-origin isolated for WASM threads), and measures round by
round, in alternating order: Python `load_onnx(threads=1)` on the site's own graphs, the page
with one WASM thread, and the isolated page with --threads WASM threads. Each measures decode
tokens/s of greedy decoding (prefill excluded; the prompt goes through the prefill graph):
Python as (t(N tokens) - t(1 token)) / (N - 1), the page as `generate`'s own
decodeTokensPerSecond (first token to last). Reports medians and each page's ratio to Python.

WHY a warm-up of --warmup-s seconds per page: V8 compiles WebAssembly with its baseline compiler
first and recompiles hot functions with its optimizing one as they run; the first few hundred
tokens after a page loads run 2-4x slower than the rest (the built-in model's step, ~800 small
kernels, needed ~1500 tokens). The first run's rate is reported too
("cold": the first --tokens tokens after the page loaded).

    python benchmarks/web_speed.py --models builtin,bench [--tokens 128] [--rounds 5] [--threads 2] [--warmup-s 15]

Needs `npm ci` (onnxruntime-web, playwright-core) and Debian's chromium (CHROMIUM overrides
/usr/bin/chromium). Run it under /work/bin/timed-style exclusivity: a busy core halves WASM.
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


class _Handler(http.server.SimpleHTTPRequestHandler):
    isolated = False

    def end_headers(self):
        if self.isolated:  # cross-origin isolation: SharedArrayBuffer, hence WASM threads
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_message(self, *args):
        pass


def serve(root: Path, isolated: bool) -> http.server.ThreadingHTTPServer:
    handler = type("H", (_Handler,), {"isolated": isolated})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def site_for(name: str, out: Path, prefill_chunk: int) -> Path:
    """The model's site under `out`, exported unless one is there (delete it after changing the
    exporter or the model); its page and module are refreshed from the package."""
    from shram_static.bench import build_model
    from shram_static.export.web import PAGE_FILES, WEB_DIR, export_web
    from shram_static.tokenizer import ByteTokenizer
    site = out / name
    if not (site / "shram.json").is_file():
        print(f"exporting {name} into {site} ...", file=sys.stderr)
        export_web(build_model(name), ByteTokenizer(), str(site), prefill_chunk=prefill_chunk)
    for f in PAGE_FILES:  # the page and module as they are now (the graphs stay)
        shutil.copyfile(WEB_DIR / f, site / f)
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
    p.add_argument("--tokens", type=int, default=128, help="new tokens per measured run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="WASM threads of the isolated page (0: skip it)")
    p.add_argument("--warmup-s", type=float, default=15.0, help="seconds each page generates before the rounds")
    p.add_argument("--node", action=argparse.BooleanOptionalAction, default=True,
                   help="also the module under Node (onnxruntime-web WASM and onnxruntime-node)")
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "out" / "web_speed"), help="where the sites are kept")
    args = p.parse_args(argv)
    from shram_static.export import load_onnx
    from shram_static.tokenizer import ByteTokenizer

    out = Path(args.out)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sites = {m: site_for(m, out, args.prefill_chunk) for m in models}
    prompt = ByteTokenizer().encode("ROMEO:")
    plain, isolated = serve(out, False), serve(out, True)
    browser = Browser()
    results = []
    try:
        for m in models:
            rel = sites[m].relative_to(out).as_posix()
            urls = {"web-1t": f"http://127.0.0.1:{plain.server_address[1]}/{rel}/index.html"}
            if args.threads:
                urls[f"web-{args.threads}t"] = (f"http://127.0.0.1:{isolated.server_address[1]}/{rel}/index.html"
                                                f"?threads={args.threads}")
            workers = ({"node-wasm-1t": NodeWorker("web", sites[m]), "node-native-1t": NodeWorker("node", sites[m])}
                       if args.node else {})
            runners = {k: functools.partial(browser.run, u) for k, u in urls.items()}
            runners.update({k: w.run for k, w in workers.items()})
            dec = load_onnx(str(sites[m] / "model.onnx"), threads=1)
            ids = torch.tensor([prompt])
            python_rate(dec, ids, 16)  # warm-up
            first = {k: run(prompt, args.tokens) for k, run in runners.items()}  # load
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
            row = {"model": m, "tokens": args.tokens, "rounds": args.rounds,
                   "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                   "ratio_to_python": {k: round(v / med["python-1t"], 3) for k, v in med.items() if k != "python-1t"},
                   "cold_tokens_per_s": {k: round(r["decodeTokensPerSecond"], 1) for k, r in first.items()},
                   "spread": {k: [round(min(v), 1), round(max(v), 1)] for k, v in rates.items()},
                   "chromium": info["web-1t"]["browser"],
                   "onnxruntime_web": info["web-1t"]["manifest"]["onnxruntime_web"],
                   "threads": {k: i["threads"] for k, i in info.items()},
                   "isolated": {k: i["crossOriginIsolated"] for k, i in info.items()}}
            results.append(row)
            print(f"{m}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in med.items()) + " | ratio "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in row["ratio_to_python"].items())
                  + " | cold (first run after load) " + ", ".join(f"{k} {v:.1f}" for k, v in row["cold_tokens_per_s"].items())
                  + " tok/s", flush=True)
            del dec
            for w in workers.values():
                w.close()
    finally:
        browser.close()
        plain.shutdown()
        isolated.shutdown()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
