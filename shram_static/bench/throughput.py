"""The `shram-static bench` command (`python -m shram_static.bench`): throughput of every backend.

For each model (the bench config, the built-in model, or a checkpoint), backend
(eager, compiled, compiled-int8/int4, pte, pte-int8, onnx, onnx-int8/int4) and batch size it
reports decode ms/step over a range of contexts (64 up to near capacity), prefill tokens/s,
export or compile warm-up time, artifact size and peak RSS, and each decode time as a ratio to
compiled torch and to the machine's floor: the bytes a decode step must read divided by the
memory read bandwidth measured in the same run
(a shared machine's bandwidth reading swings by 2x between runs, so only same-run ratios compare).
A quantized backend's floor counts its weights as stored (`readings.decode_read_bytes`), and its
speed is also given against the float program of the same format (`pte-int8` against `pte`,
`compiled-int8` against `compiled`).

Every backend runs in a subprocess of its own, so its peak RSS and compile caches are its own;
an exported backend is exported in one subprocess and run from the file in another, so its peak
RSS is the runtime's, not the exporter's. The runtimes are loaded one after another and then
measured interleaved: at each context every backend runs in turn, `--rounds` times, so the
ratios compare measurements taken minutes apart at most (the machine's speed drifts by tens of
percent within minutes), and the bandwidth behind the floor is read between those rounds.
All the runtimes of one run are held in memory at once (idle ones wait on their stdin).
"""

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..backends import BACKENDS, EXPORTED, find_backend, float_partner
from ..console import info
from .readings import (bandwidth_buffer, bandwidth_spread, cpu_times, decode_read_bytes, measure_bandwidth,
                       peak_rss_mib, steal_fraction)

BENCH_CONFIG = dict(vocab_size=50277, embedding_width=512, mlp_width=1366, num_decoder_layers=12,
                    num_sliding_window_heads=16, num_mosrah_heads=16, num_selected_heads=4,
                    head_dim=16, window_size=128, training_sequence_length=1024,
                    inference_sequence_length=2048)
# A prompt is prefilled again (after a reset) while its runs so far took under PREFILL_REPEAT_S
# seconds, PREFILL_RUNS at most, and timed as their median: a single run of a short prompt
# swings between rounds far more than the backends differ (docs/performance.md, "Measuring").
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
    elif not os.path.isdir(name):
        raise ValueError(f"unknown model {name!r}: use 'bench', 'builtin' or a checkpoint directory")
    if capacity is None:
        return ShramForCausalLM.from_pretrained(name)
    cfg = ShramConfig.from_json_file(os.path.join(name, "config.json"))
    cfg.inference_sequence_length = capacity
    return ShramForCausalLM.from_pretrained(name, config=cfg)


def check_depths(depths: list[int] | None, steps: int, capacity: int) -> None:
    """ValueError unless each of `depths` (None: the defaults) leaves room for `steps` steps in `capacity`."""
    if depths and max(depths) + steps >= capacity:
        raise ValueError(f"--depths must leave room for {steps} decode steps within the capacity {capacity}: "
                         f"at most {capacity - steps - 1}, got {max(depths)}")


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
    if b.runtime == "onnx":
        files = list(export_onnx(model, path, batch_size=batch_size, prefill_chunk=prefill_chunk,
                                 quantize=b.quantize).values())
    else:
        files = [export_pte(model, path, batch_size=batch_size, prefill_chunk=prefill_chunk,
                            quantize=b.quantize)]
    # (The forked process of a parallel export has a peak of its own, not counted here: Linux
    # reports a child's `ru_maxrss` from at least the parent's size when it forked.)
    return dict(export_s=round(time.perf_counter() - t, 1),
                file_mib=round(sum(os.path.getsize(f) for f in files) / 2**20, 1),
                export_peak_rss_mib=peak_rss_mib())


class Runner:
    """One loaded backend in this process: loads (compiling or reading the file) and warms up on
    construction, then measures one context per `measure` call.

    Args: as `bench`'s per-job options; `out_dir` holds the exported artifact, if any.
    """

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
        elif b.runtime == "onnx":
            from ..export import load_onnx
            dec = load_onnx(artifact_path(out_dir, backend))
        else:
            from ..export import load_pte
            dec = load_pte(artifact_path(out_dir, backend))
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        dec.warm_up()  # compiles (compiled: every prefix length, past 4096 slots too)
        self.dec, self.steps = dec, steps
        self.info = dict(model=model_name, backend=backend, batch=B, chunk=prefill_chunk,
                         warmup_s=round(time.perf_counter() - t, 2),
                         read_bytes=decode_read_bytes(model, B, prefill_chunk, find_backend(backend).quantize),
                         state_bytes=state_bytes(cfg, B, prefill_chunk), capacity=S,
                         contexts=depths or contexts(S, steps))

    def measure(self, ctx: int) -> dict:
        """Prefills `ctx` tokens per row (a short prompt several times: PREFILL_REPEAT_S), then
        times `steps` decode steps one by one after the last prefill.

        Returns:
            dict(prefill_s=median seconds for the prompt, decode_s=[seconds per decode step]).
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
    """Worker loop: says it has started (its imports are done), waits for a line on stdin, builds
    a `Runner`, replies with its info, then answers one JSON request per line on stdin
    ({"context": c} -> `measure(c)`; {"done": true} -> peak RSS, then exits).

    WHY the protocol goes to a duplicate of stdout while fd 1 points at stderr: whatever the
    libraries print (Python or C) must not interleave with the replies."""
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
    """The parent's handle on one `serve` subprocess (one model, backend and batch size).

    The process starts (imports the package) at construction; `load` builds its runtime.

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
        """Waits for a finished worker to exit; kills one that was not asked to finish (an
        error elsewhere). WHY finish all, then close all: each interpreter's shutdown takes
        a while, and this way they overlap."""
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

    For each context index, each round runs every worker once in turn (in the given order in
    even rounds, reversed in odd ones), so the backends compared at a context are measured
    minutes apart at most, on a machine whose speed drifts (a backend's readings minutes apart
    can differ by tens of percent). Each worker's decode time at
    a context is the median of all its timed steps over the rounds; prefill, the median prefill.
    `decode_ms_best` is the lowest of the rounds' own medians: on a machine shared with other
    work, noise only adds time, and a step of hundreds of small parallel operators (a `.pte`)
    loses far more to a busy stretch than a few large ones (docs/performance.md, "Measuring").
    With `bandwidth`, each point also keeps `rounds`: each round's median and the reading taken
    just before that round, which `add_ratios` pairs (a VM's memory can change speed mid-run).

    Args:
        workers: objects with `.contexts` (list of ints) and `.measure(ctx) -> dict(prefill_s,
            decode_s)` (a `Worker`, or a fake in tests).
        rounds: measurements per worker and context.
        bandwidth: called once per round of each context (between the workers' turns);
            its readings are returned, so the floor is measured in the same periods.
        progress: called with a line of text after each round.

    Returns:
        (points per worker: [dict(context, prefill_tok_s, decode_ms, decode_ms_best,
        decode_tok_s[, rounds=[dict(ms, gb_s)]])], readings).
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
            # forward in even rounds, backward in odd ones: no backend always runs right after
            # the bandwidth reading or right after the same neighbour
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
    """Adds the floor (`read_bytes` over `bandwidth`: a quantized backend's own, its weights as
    stored) and, per context point, `x_floor` = decode time / floor (1 is the ideal; for a point
    with `rounds`, the median of each round's time over the floor of the reading taken just
    before it, so a round that met the memory's other speed is not held to this floor),
    `x_compiled` = decode speed / compiled torch's at the same model, batch size and context
    (above 1: faster than compiled torch; None without a compiled result) and `x_compiled_best`,
    the same from both backends' best rounds (`measure_interleaved`). A quantized backend's
    points also get `x_float`: its speed / the float program's of the same format (`pte-int8`
    against `pte`), None without one."""
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
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        raise ValueError(f"unknown backends {bad}: choose from {BACKENDS}")
    bad = [m for m in args.models
           if m not in ("bench", "builtin") and not os.path.isfile(os.path.join(m, "config.json"))]
    if bad:
        raise ValueError(f"unknown models {bad}: use 'bench', 'builtin' or checkpoint directories "
                         f"(with a config.json)")
    if any(b < 1 for b in args.batch_sizes) or args.steps < 1 or args.prefill_chunk < 1:
        raise ValueError("--batch-sizes, --steps and --prefill-chunk must be positive")
    if args.rounds < 1:
        raise ValueError("--rounds must be positive")
    if args.capacity:  # before any worker starts; a model's own capacity is checked in its worker
        check_depths(args.depths, args.steps, args.capacity)
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
            # One worker per job. Their processes start at once (each interpreter's imports,
            # seconds of CPU, overlap); once all have started, they load one after another
            # (warm-up times without contention), then idle (blocked on stdin) while the
            # others run.
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

    def ratio(p):
        if p["x_compiled"] is None:
            return ""
        best = p.get("x_compiled_best")
        return f", {p['x_compiled']:.2f}x compiled's speed" + (f" (best rounds {best:.2f}x)" if best is not None else "")

    def float_ratio(p):
        return f", {p['x_float']:.2f}x the float program's speed" if p.get("x_float") is not None else ""

    built = (f"export {r['export_s']:.0f} s, file {r['file_mib']:.1f} MiB" if "export_s" in r
             else f"warm-up {r['warmup_s']:.1f} s")
    return (f"{r['model']:>7} {r['backend']:>8} B={r['batch']}: decode {a['decode_ms']:.2f} ms "
            f"@ctx{a['context']} ({a['x_floor']:.2f}x floor{ratio(a)}{float_ratio(a)}), {z['decode_ms']:.2f} ms "
            f"@ctx{z['context']} ({z['x_floor']:.2f}x floor{ratio(z)}{float_ratio(z)}) | floor {r['floor_ms']:.2f} ms "
            f"({r['read_bytes'] / 1e6:.1f} MB) | prefill {a['prefill_tok_s']:.0f} tok/s @{a['context']}, "
            f"{z['prefill_tok_s']:.0f} @{z['context']} | {built} | state {r['state_bytes'] / 2**20:.1f} MiB "
            f"| peak RSS {r['peak_rss_mib']:.0f} MiB")
