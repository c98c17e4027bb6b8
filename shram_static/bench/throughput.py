"""The `shram-static bench` command (`python -m shram_static.bench`): decode and prefill speed of
every backend against compiled torch and the floor (the bytes a step reads over the same run's memory
bandwidth), each backend in worker subprocesses, interleaved (docs/reference.md, "shram-static bench")."""

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..backends import EXPORTED, find_backend, float_partner
from ..console import info
from .checks import check_depths, check_models
from .readings import (bandwidth_buffer, bandwidth_spread, cpu_times, decode_read_bytes, measure_bandwidth,
                       peak_rss_mib, steal_fraction)

BENCH_CONFIG = dict(vocab_size=50277, embedding_width=512, mlp_width=1366, num_decoder_layers=12,
                    num_sliding_window_heads=16, num_mosrah_heads=16, num_selected_heads=4,
                    head_dim=16, window_size=128, training_sequence_length=1024,
                    inference_sequence_length=2048)
# A prompt is prefilled again while its runs took under PREFILL_REPEAT_S s (PREFILL_RUNS at most),
# timed as their median: one run of a short prompt swings far more than the backends differ.
PREFILL_REPEAT_S, PREFILL_RUNS = 1.0, 5


def build_model(name: str, capacity: int | None = None):
    """'bench' (the bench config, seeded weights), 'builtin', or a checkpoint directory, with
    `capacity` live tokens per row (`inference_sequence_length`; None: the model's own)."""
    from ..config import ShramConfig
    from ..model import ShramForCausalLM
    if name == "bench":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            cfg = ShramConfig(**{**BENCH_CONFIG, **({"inference_sequence_length": capacity} if capacity else {})})
            return ShramForCausalLM(cfg)
    if name == "builtin":
        from ..default_model import BUILTIN_DIR
        name = BUILTIN_DIR
    else:
        check_models([name])
    if capacity is None:
        return ShramForCausalLM.from_pretrained(name)
    cfg = ShramConfig.from_json_file(os.path.join(name, "config.json"))
    cfg.inference_sequence_length = capacity
    return ShramForCausalLM.from_pretrained(name, config=cfg)


def contexts(capacity: int, steps: int) -> list[int]:
    """Context lengths measured: 64, quarter, half and three quarters of capacity, and near it."""
    near = capacity - steps - 1
    return sorted({c for c in (64, capacity // 4, capacity // 2, 3 * capacity // 4, near) if 0 < c <= near})


def artifact_path(out_dir: str, backend: str) -> str:
    b = find_backend(backend)
    return os.path.join(out_dir, f"model{'.' + b.quantize if b.quantize else ''}.{b.runtime}")


def export_one(model_name: str, backend: str, batch_size: int, prefill_chunk: int, out_dir: str,
               capacity: int | None = None) -> dict:
    """Exports one artifact in this process; returns export time and file size."""
    from ..export import export_onnx, export_pte
    model = build_model(model_name, capacity)
    path = artifact_path(out_dir, backend)
    t = time.perf_counter()
    b = find_backend(backend)
    kw = dict(batch_size=batch_size, prefill_chunk=prefill_chunk, quantize=b.quantize)
    if b.runtime == "onnx":
        files = list(export_onnx(model, path, **kw).values())
    else:
        files = [export_pte(model, path, **kw)]
    # (a parallel export's forked child has a peak of its own, not counted here: Linux reports a
    # child's `ru_maxrss` from at least the parent's size when it forked)
    return dict(export_s=round(time.perf_counter() - t, 1),
                file_mib=round(sum(os.path.getsize(f) for f in files) / 2**20, 1),
                export_peak_rss_mib=peak_rss_mib())


class Runner:
    """One backend loaded and warmed up in this process; `measure` times one context.
    Args: as `bench`'s per-job options; `out_dir` holds the exported artifact, if any."""

    def __init__(self, model_name: str, backend: str, batch_size: int, prefill_chunk: int, steps: int,
                 out_dir: str | None = None, capacity: int | None = None, depths: list[int] | None = None):
        from ..decoder import StaticDecoder
        from ..state import state_bytes
        torch.manual_seed(0)
        model = build_model(model_name, capacity)
        cfg = model.config
        B, S = batch_size, cfg.inference_sequence_length
        check_depths(depths, steps, S)
        t = time.perf_counter()
        b = find_backend(backend)
        if b.runtime not in EXPORTED:
            dec = StaticDecoder(model, batch_size=B, prefill_chunk=prefill_chunk, compile=b.runtime == "compiled",
                                quantize=b.quantize)
        else:
            from ..export import load_onnx, load_pte
            dec = (load_onnx if b.runtime == "onnx" else load_pte)(artifact_path(out_dir, backend))
        self.ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
        dec.warm_up()  # compiles (compiled: every prefix length, past 4096 slots too)
        self.dec, self.steps = dec, steps
        self.info = dict(model=model_name, backend=backend, batch=B, chunk=prefill_chunk,
                         warmup_s=round(time.perf_counter() - t, 2),
                         read_bytes=decode_read_bytes(model, B, prefill_chunk, b.quantize,
                                                      compiled_ops=b.runtime not in EXPORTED),
                         state_bytes=state_bytes(cfg, B, prefill_chunk), capacity=S,
                         contexts=depths or contexts(S, steps))

    def measure(self, ctx: int) -> dict:
        """Prefills `ctx` tokens per row, then times `steps` decode steps one by one.

        Returns:
            dict(prefill_s=median seconds of the prefill, decode_s=[seconds per decode step]).
        """
        runs = []
        while not runs or (len(runs) < PREFILL_RUNS and sum(runs) < PREFILL_REPEAT_S):
            self.dec.reset()
            t = time.perf_counter()
            self.dec.prefill(self.ids[:, :ctx], last_only=True)  # peak RSS: the runtime's, not a (B, ctx, V) result
            runs.append(time.perf_counter() - t)
        prefill_s = statistics.median(runs)
        times = []
        for i in range(self.steps):
            t = time.perf_counter()
            self.dec.decode(self.ids[:, ctx + i])
            times.append(time.perf_counter() - t)
        return dict(prefill_s=prefill_s, decode_s=times)


def serve(runner_args: list) -> None:
    """Worker loop: a `Runner` on the first stdin line, then a JSON reply per request line ({"context": c},
    {"done": true}). WHY replies go to a duplicate of stdout, fd 1 to stderr: library output stays out."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proto.write(json.dumps(dict(started=True)) + "\n")
    if not sys.stdin.readline():  # the parent went away before loading this worker
        return
    runner = Runner(*runner_args)
    proto.write(json.dumps(runner.info) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("done"):
            proto.write(json.dumps(dict(peak_rss_mib=peak_rss_mib())) + "\n")
            return
        proto.write(json.dumps(runner.measure(req["context"])) + "\n")


class Worker:
    """The parent's handle on one `serve` subprocess, started at construction; `load` builds its runtime.

    Args:
        args: the worker's command-line options (`--model ... --backend ...`).
        label: names the worker in progress lines and errors.
    """

    def __init__(self, args: list[str], label: str):
        self.label = label
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: no deadlock on a full pipe
        self.proc = subprocess.Popen([sys.executable, "-m", "shram_static.bench", "--worker", "serve", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, bufsize=1)
        self.info: dict = {}
        self.contexts: list[int] = []
        self.finished = False

    def started(self) -> None:
        """Waits until the worker's imports are done."""
        self.reply()

    def load(self) -> dict:
        """Builds the worker's runtime (export load or compile warm-up); returns its info."""
        self.info = self.ask(dict(load=True))
        self.contexts = self.info["contexts"]
        return self.info

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.err.seek(0)
            raise RuntimeError(f"benchmark worker {self.label} failed (exit {self.proc.returncode}):\n"
                               f"{self.err.read()[-3000:]}")
        return json.loads(line)

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def measure(self, ctx: int) -> dict:
        return self.ask(dict(context=ctx))

    def finish(self) -> dict:
        """The worker's peak RSS; the worker then exits (`close` waits for it)."""
        self.finished = True
        return self.ask(dict(done=True))

    def close(self) -> None:
        """Waits for a finished worker to exit; kills one not asked to finish (an error elsewhere).
        WHY finish all, then close all: the interpreters' slow shutdowns overlap."""
        if self.proc.poll() is None:
            if self.finished:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=60)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def measure_interleaved(workers: list, rounds: int, bandwidth=None, progress=None) -> tuple[list[dict], list[float]]:
    """Measures every worker at each of its contexts, `rounds` times, interleaved.

    `decode_ms_best` is the lowest round median (noise only adds time); `rounds` pairs them with readings.

    Args:
        workers: objects with `.contexts` and `.measure(ctx) -> dict(prefill_s, decode_s)`.
        rounds: measurements per worker and context.
        bandwidth: called once per round of each context, between the workers' turns.
        progress: called with a line of text after each round.

    Returns:
        (points per worker: [dict(context, prefill_tok_s, decode_ms, decode_ms_best,
        decode_tok_s[, rounds=[dict(ms, gb_s)]])], bandwidth readings).
    """
    points = [[] for _ in workers]
    readings = []
    depth = max(len(w.contexts) for w in workers)
    for i in range(depth):
        got = [dict(prefill=[], decode=[], rounds=[]) for _ in workers]
        here = []  # this context's readings, one per round
        for r in range(rounds):
            if bandwidth is not None:
                here.append(bandwidth())
            # reversed in odd rounds: no backend always runs right after the reading or the same neighbour
            turns = list(zip(workers, got))
            for w, g in (turns if r % 2 == 0 else turns[::-1]):
                if i < len(w.contexts):
                    m = w.measure(w.contexts[i])
                    g["prefill"].append(m["prefill_s"])
                    g["decode"].extend(m["decode_s"])
                    g["rounds"].append(statistics.median_high(m["decode_s"]))
            if progress is not None:
                progress(f"context index {i + 1}/{depth}, round {r + 1}/{rounds} done")
        for w, g, pts in zip(workers, got, points):
            if i < len(w.contexts):
                ctx, B = w.contexts[i], w.info["batch"]
                med, pre = statistics.median_high(g["decode"]), statistics.median_high(g["prefill"])
                pts.append(dict(context=ctx, prefill_tok_s=round(B * ctx / pre, 1),
                                decode_ms=round(1e3 * med, 3), decode_ms_best=round(1e3 * min(g["rounds"]), 3),
                                decode_tok_s=round(B / med, 1)))
                if here:
                    pts[-1]["rounds"] = [dict(ms=round(1e3 * t, 3), gb_s=round(bw / 1e9, 2))
                                         for t, bw in zip(g["rounds"], here)]
        readings += here
    return points, readings


def add_ratios(results: list[dict], bandwidth: float) -> None:
    """Adds `floor_ms` (`read_bytes` / `bandwidth`) and per point `x_floor` (time / floor; with `rounds`, the
    median of each round against its own reading), `x_compiled`, `x_compiled_best` (speed / compiled torch's
    at the same context; None without) and, quantized, `x_float` (speed / the float program's)."""
    by_backend = {(r["model"], r["batch"], r["backend"]): r for r in results}
    for r in results:
        r["floor_ms"] = round(1e3 * r["read_bytes"] / bandwidth, 3)
        ref = by_backend.get((r["model"], r["batch"], "compiled"))
        ref_pts = {p["context"]: p for p in ref["points"]} if ref else {}
        quantized = find_backend(r["backend"]).quantize is not None
        flt = by_backend.get((r["model"], r["batch"], float_partner(r["backend"]))) if quantized else None
        flt_pts = {p["context"]: p for p in flt["points"]} if flt else {}
        for p in r["points"]:
            paired = [q["ms"] * q["gb_s"] * 1e6 / r["read_bytes"] for q in p.get("rounds", [])]
            p["x_floor"] = round(statistics.median(paired) if paired else p["decode_ms"] / r["floor_ms"], 2)
            q = ref_pts.get(p["context"])
            p["x_compiled"] = round(q["decode_ms"] / p["decode_ms"], 2) if q else None
            p["x_compiled_best"] = round(q["decode_ms_best"] / p["decode_ms_best"], 2) if q else None
            if quantized:
                f = flt_pts.get(p["context"])
                p["x_float"] = round(f["decode_ms"] / p["decode_ms"], 2) if f else None


def _subprocess(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, "-m", "shram_static.bench", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"benchmark worker {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench(args) -> int:
    """Runs the `bench` command's measurements and prints them.

    Args:
        args: its parsed arguments (`cli.add_arguments`), already checked by the caller
            (`checks.check_bench`: `cli` does so before it imports this module).

    Returns:
        the exit status, 0.
    """
    jobs = [(m, be, b) for m in args.models for b in args.batch_sizes for be in args.backends]
    x = bandwidth_buffer()  # 1 GiB, held for the bandwidth readings between rounds
    bandwidth = lambda: measure_bandwidth(x)  # noqa: E731
    print(f"memory read bandwidth (torch.sum over 1 GiB, {torch.get_num_threads()} threads): "
          f"{bandwidth() / 1e9:.1f} GB/s", flush=True)
    workers, results = [], []
    with tempfile.TemporaryDirectory(prefix="shram_bench_") as tmp:
        shape = ((["--capacity", str(args.capacity)] if args.capacity else [])
                 + (["--depths", *map(str, args.depths)] if args.depths else []))
        opts = [["--model", m, "--backend", be, "--batch-size", str(b), "--prefill-chunk",
                 str(args.prefill_chunk), "--steps", str(args.steps), "--out-dir", os.path.join(tmp, str(i)), *shape]
                for i, (m, be, b) in enumerate(jobs)]
        try:
            for i, (m, be, b) in enumerate(jobs):
                os.makedirs(os.path.join(tmp, str(i)))
                results.append({})
                if find_backend(be).runtime in EXPORTED:
                    info(f"[{i + 1}/{len(jobs)}] exporting model={m} backend={be} batch={b} "
                         f"(minutes for a large model) ...")
                    results[i] = _subprocess(["--worker", "export", *opts[i]])
            # the workers start at once (imports overlap), then load one after another (no contention)
            info(f"starting {len(jobs)} benchmark workers ...")
            for i, (m, be, b) in enumerate(jobs):
                workers.append(Worker(opts[i], f"{m}/{be}/B={b}"))  # appended: killed on error
            for w in workers:
                w.started()
            for i, ((m, be, b), w) in enumerate(zip(jobs, workers)):
                info(f"[{i + 1}/{len(jobs)}] loading model={m} backend={be} batch={b} ...")
                info(f"  ready in {w.load()['warmup_s']:.0f} s")
            info(f"measuring {len(workers)} backends interleaved, {args.rounds} rounds per context ...")
            t0 = cpu_times()
            points, readings = measure_interleaved(workers, args.rounds, bandwidth, info)
            steal = steal_fraction(t0, cpu_times())
            for w, r, pts in zip(workers, results, points):
                r.update({k: v for k, v in w.info.items() if k != "contexts"}, points=pts, **w.finish())
        finally:
            for w in workers:
                w.close()
    bw = statistics.median_high(readings)
    print(f"memory read bandwidth, median of {len(readings)} readings between rounds: {bw / 1e9:.1f} GB/s "
          f"(min {min(readings) / 1e9:.1f}, max {max(readings) / 1e9:.1f})", flush=True)
    if spread := bandwidth_spread(readings):
        print(f"warning: {spread}", flush=True)
    if steal is not None:
        print(f"CPU time stolen by the hypervisor during the measurements: {100 * steal:.0f}%"
              + (" (above 10%: the speed figures, the .pte's most, read the machine's load more than the "
                 "code; measure again in a quieter hour)" if steal > 0.1 else ""), flush=True)
    add_ratios(results, bw)
    for r in results:
        print(format_row(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth_bytes_s=bw, steal_fraction=steal, results=results), f, indent=1)
    if args.plot:
        from .plot import plot
        plot(results, args.plot)
    return 0


def format_row(r: dict) -> str:
    a, z = r["points"][0], r["points"][-1]

    def decode(p: dict) -> str:
        s = f"{p['decode_ms']:.2f} ms @ctx{p['context']} ({p['x_floor']:.2f}x floor"
        if p["x_compiled"] is not None:
            s += f", {p['x_compiled']:.2f}x compiled's speed"
            if p.get("x_compiled_best") is not None:
                s += f" (best rounds {p['x_compiled_best']:.2f}x)"
        if p.get("x_float") is not None:
            s += f", {p['x_float']:.2f}x the float program's speed"
        return s + ")"

    built = (f"export {r['export_s']:.0f} s, file {r['file_mib']:.1f} MiB" if "export_s" in r
             else f"warm-up {r['warmup_s']:.1f} s")
    return (f"{r['model']:>7} {r['backend']:>8} B={r['batch']}: decode {decode(a)}, {decode(z)} | floor "
            f"{r['floor_ms']:.2f} ms ({r['read_bytes'] / 1e6:.1f} MB) | prefill {a['prefill_tok_s']:.0f} tok/s "
            f"@{a['context']}, {z['prefill_tok_s']:.0f} @{z['context']} | {built} | state "
            f"{r['state_bytes'] / 2**20:.1f} MiB | peak RSS {r['peak_rss_mib']:.0f} MiB")
