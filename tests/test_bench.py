"""`shram-static bench`: ratios against compiled torch and the floor, and the command end to end
(eager on a tiny checkpoint: speed itself is never asserted; the benchmark reports it)."""

import json
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from helpers import TINY_CONFIG, randomize_
from shram_static import ShramConfig, ShramForCausalLM
from shram_static.bench import cli as bench_cli, throughput as bench_mod
from shram_static.bench.throughput import add_ratios, contexts, measure_interleaved


def _result(backend, ms, model="m", batch=1, read_bytes=2_000_000, best=None):
    """A result as `bench` assembles it; the best rounds' medians default to the medians."""
    points = [dict(context=c, decode_ms=m, decode_ms_best=b) for c, m, b in zip((64, 200), ms, best or ms)]
    return dict(model=model, backend=backend, batch=batch, read_bytes=read_bytes, points=points)


def test_ratios_are_against_the_same_model_batch_and_context():
    rs = [_result("compiled", (2.0, 4.0)), _result("pte", (3.0, 2.0)),
          _result("pte", (5.0, 5.0), batch=4), _result("compiled", (1.0, 1.0), model="other")]
    add_ratios(rs, bandwidth=1e9)  # 2 MB at 1 GB/s: a 2 ms floor
    assert rs[0]["floor_ms"] == 2.0
    assert [p["x_compiled"] for p in rs[1]["points"]] == [0.67, 2.0]  # speed: compiled ms / pte ms
    assert [p["x_floor"] for p in rs[1]["points"]] == [1.5, 1.0]
    assert [p["x_compiled"] for p in rs[2]["points"]] == [None, None]  # no compiled run at B=4
    assert [p["x_compiled_best"] for p in rs[2]["points"]] == [None, None]
    # the best-round ratio pairs each backend's own quietest round
    rs = [_result("compiled", (2.0, 4.0), best=(1.5, 3.0)), _result("pte", (3.0, 2.0), best=(1.5, 1.0))]
    add_ratios(rs, bandwidth=1e9)
    assert [p["x_compiled"] for p in rs[1]["points"]] == [0.67, 2.0]
    assert [p["x_compiled_best"] for p in rs[1]["points"]] == [1.0, 3.0]


def test_each_round_is_held_to_the_floor_of_its_own_reading():
    """A round that met the memory at another speed is held to the floor of the reading taken
    just before it: the ratio is the median of the rounds' own ratios, not the median time over
    the run's median floor."""
    r = _result("compiled", (7.0, 7.0), read_bytes=200_000_000)
    r["points"][0]["rounds"] = [dict(ms=8.0, gb_s=35.0), dict(ms=6.0, gb_s=70.0)]  # x 1.4 and 2.1
    add_ratios([r], bandwidth=52.5e9)  # floor 3.81 ms: 7 ms would read 1.84x
    assert [p["x_floor"] for p in r["points"]] == [1.75, 1.84]


def test_a_quantized_backend_is_also_compared_with_its_float_program():
    rs = [_result("compiled", (2.0, 4.0)), _result("pte", (3.0, 2.0)), _result("pte-int8", (1.5, 1.0)),
          _result("pte-int8", (1.0, 1.0), batch=4)]
    add_ratios(rs, bandwidth=1e9)
    assert [p["x_float"] for p in rs[2]["points"]] == [2.0, 2.0]  # pte ms / int8 ms
    assert [p["x_compiled"] for p in rs[2]["points"]] == [1.33, 4.0]
    assert [p["x_float"] for p in rs[3]["points"]] == [None, None]  # no float .pte at B=4
    assert all("x_float" not in p for r in rs[:2] for p in r["points"])
    assert "2.00x the float program's speed" in bench_mod.format_row(
        {**rs[2], "warmup_s": 1.0, "state_bytes": 1, "peak_rss_mib": 1.0,
         "points": [{**p, "prefill_tok_s": 1.0} for p in rs[2]["points"]]})


@pytest.mark.parametrize("tied", [False, True])
def test_a_quantized_floor_counts_the_linear_weights_as_stored(tied):
    """The int8 and 8da4w floors against a count by parameter name: each linear weight the
    step reads (projections, K of L experts, the head) at 1 byte (int8) or half a byte (int4
    groups of 32 inputs, experts excluded) plus an fp32 scale per output channel or group; with
    `compiled_ops` (the compiled quantized decoders) each linear's buffers as `int_kernels.pack`
    makes them and int8 experts."""
    from shram_static.export.quantize import GROUP
    from shram_static.bench.readings import decode_read_bytes

    cfg = ShramConfig(**{**TINY_CONFIG, "tie_word_embeddings": tied})
    model = ShramForCausalLM(cfg)
    K, L = cfg.num_selected_heads, cfg.num_mosrah_heads
    weights = []  # (elements read, out channels, input width, expert)
    for name, p in model.named_parameters():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            weights.append((p.numel(), p.shape[0], p.shape[1], False))
        elif ".bea." in name:  # (L, d, u) or (L, u, d): K of the L experts, u or d outputs each
            weights.append((p.numel() * K // L, K * p.shape[2], p.shape[1], True))
    if tied:
        weights.append((cfg.vocab_size * cfg.embedding_width, cfg.vocab_size, cfg.embedding_width, False))
    W = sum(n for n, *_ in weights)
    flt = decode_read_bytes(model, 1, 8)
    assert decode_read_bytes(model, 1, 8, "int8") == flt - 4 * W + W + 4 * sum(o for _, o, _, _ in weights)
    # the compiled quantized decoders: each linear's packed weight and fp16 scales as the ops
    # store them, int8 experts with a scale per expert output
    from shram_static.int_kernels import pack
    eight_e = sum(n + 4 * o for n, o, i, e in weights if e)
    for mode, bits in (("int4", 4), ("int8", 8)):
        packed = 0
        for n, o, i, e in weights:
            if not e:
                w, s = pack(torch.zeros(o, -(-i // GROUP) * GROUP), torch.zeros(o, -(-i // GROUP)), bits)
                packed += w.numel() + 2 * s.numel()
        assert decode_read_bytes(model, 1, 8, mode, compiled_ops=True) == int(flt - 4 * W + packed + eight_e), mode
    four = [(n, o, i) for n, o, i, e in weights if i % GROUP == 0 and not e]  # the exporter's int4 groups
    eight = [(n, o) for n, o, i, e in weights if not (i % GROUP == 0 and not e)]
    assert decode_read_bytes(model, 1, 8, "8da4w") == int(
        flt - 4 * W + sum(n / 2 + 4 * o * (i // GROUP) for n, o, i in four) + sum(n + 4 * o for n, o in eight))


class _Fake:
    """Records every measure call in a shared log; decode times are given per call."""

    def __init__(self, name, contexts, batch, log, times):
        self.name, self.contexts, self.info, self.log, self.times = name, contexts, dict(batch=batch), log, times

    def measure(self, ctx):
        self.log.append((self.name, ctx))
        return dict(prefill_s=ctx / 100, decode_s=self.times.pop(0))


class _TimedDecoder:
    """A decoder whose prefill takes the given seconds, call by call; logs every call."""

    def __init__(self, prefill_s):
        self.prefill_s, self.log = list(prefill_s), []

    def reset(self):
        self.log.append("reset")

    def prefill(self, ids, last_only):
        self.log.append(("prefill", ids.shape[1]))
        time.sleep(self.prefill_s.pop(0))

    def decode(self, ids):
        self.log.append("decode")


def _runner(prefill_s, steps=2):
    r = object.__new__(bench_mod.Runner)  # only what measure() reads: no model, no runtime
    r.dec, r.steps, r.ids = _TimedDecoder(prefill_s), steps, torch.zeros(1, 100, dtype=torch.long)
    return r


def test_a_short_prompt_is_prefilled_several_times_and_timed_as_the_median(monkeypatch):
    monkeypatch.setattr(bench_mod, "PREFILL_REPEAT_S", 0.5)
    r = _runner([0.2, 0.01, 0.01, 0.01, 0.01, 9])  # a slow first run, then fast ones
    m = r.measure(10)
    assert r.dec.log == ["reset", ("prefill", 10)] * 5 + ["decode"] * 2  # PREFILL_RUNS, decode after the last
    assert 0.01 <= m["prefill_s"] < 0.1 and len(m["decode_s"]) == 2


def test_a_long_prompt_is_prefilled_until_the_time_is_spent(monkeypatch):
    monkeypatch.setattr(bench_mod, "PREFILL_REPEAT_S", 0.05)
    r = _runner([0.03, 0.03, 9])
    m = r.measure(10)
    assert r.dec.log == ["reset", ("prefill", 10)] * 2 + ["decode"] * 2
    assert 0.03 <= m["prefill_s"] < 0.1


def test_measurements_interleave_backends_round_by_round():
    """At each context every backend runs once per round, in turn, the order reversed every
    other round; the decode figure is the median over all rounds' steps, prefill the median
    prefill; the best round is the lowest of the rounds' own medians."""
    log, reads = [], []
    a = _Fake("a", [64, 128], 1, log, [[0.010, 0.012], [0.011, 0.013], [0.020], [0.030], [0.040], [0.050]])
    b = _Fake("b", [64], 4, log, [[0.001], [0.002], [0.003], [0.004], [0.005]])
    points, readings = measure_interleaved([a, b], rounds=2, bandwidth=lambda: reads.append(1) or 5e9)
    assert log == [("a", 64), ("b", 64), ("b", 64), ("a", 64), ("a", 128), ("a", 128)]
    assert readings == [5e9] * 4 and len(reads) == 4  # one reading per round of each context
    assert [p["context"] for p in points[0]] == [64, 128] and [p["context"] for p in points[1]] == [64]
    assert points[0][0]["decode_ms"] == 12.0  # median of 10, 12, 11, 13 ms (upper middle)
    assert points[0][1]["decode_ms"] == 30.0  # median of 20, 30
    assert points[1][0]["decode_ms"] == 2.0 and points[1][0]["decode_tok_s"] == 2000.0  # B=4 rows
    assert points[0][0]["prefill_tok_s"] == 100.0 and points[1][0]["prefill_tok_s"] == 400.0
    # rounds' medians: a@64 12 and 13 ms, a@128 20 and 30, b@64 1 and 2
    assert [p["decode_ms_best"] for p in points[0]] == [12.0, 20.0] and points[1][0]["decode_ms_best"] == 1.0
    # each round's median beside the reading taken just before that round
    assert points[0][0]["rounds"] == [dict(ms=12.0, gb_s=5.0), dict(ms=13.0, gb_s=5.0)]
    assert "rounds" not in measure_interleaved([_Fake("c", [64], 1, [], [[0.01]])], rounds=1)[0][0][0]


def test_workers_all_start_before_any_loads(monkeypatch):
    """Every worker process starts (its imports, seconds each) before the first one loads, and
    they load one after another (warm-up times without contention); all are asked to finish
    before the first exit is waited for (their shutdowns overlap)."""
    import shram_static.bench.throughput as bench_mod

    log = []

    class Recorder:
        def __init__(self, args, label):
            self.label = label
            log.append(("start", label))

        def started(self):
            log.append(("started", self.label))

        def load(self):
            log.append(("load", self.label))
            self.info = dict(model="bench", backend="eager", batch=int(self.label[-1]), chunk=8,
                             warmup_s=1.0, read_bytes=10**6, state_bytes=1, contexts=[64])
            self.contexts = [64]
            return self.info

        def measure(self, ctx):
            return dict(prefill_s=0.1, decode_s=[0.01])

        def finish(self):
            log.append(("finish", self.label))
            return dict(peak_rss_mib=1.0)

        def close(self):
            log.append(("close", self.label))

    monkeypatch.setattr(bench_mod, "Worker", Recorder)
    monkeypatch.setattr(bench_mod, "measure_bandwidth", lambda x=None, reps=5: 1e10)
    monkeypatch.setattr(bench_mod, "bandwidth_buffer", lambda: None)  # no 1 GiB to allocate here
    assert bench_cli.main(["--models", "bench", "--backends", "eager", "--batch-sizes", "1", "2",
                           "--rounds", "1"]) == 0
    a, b = "bench/eager/B=1", "bench/eager/B=2"
    assert log == [("start", a), ("start", b), ("started", a), ("started", b),
                   ("load", a), ("load", b), ("finish", a), ("finish", b), ("close", a), ("close", b)]


def test_close_waits_for_a_finished_worker_and_kills_one_that_was_not():
    from shram_static.bench.throughput import Worker

    def worker(cmd, finished):
        w = Worker.__new__(Worker)  # a process standing in for a worker
        w.proc, w.err, w.finished = subprocess.Popen(cmd), tempfile.TemporaryFile(mode="w+"), finished
        return w
    busy = worker(["sleep", "30"], finished=False)
    t = time.perf_counter()
    busy.close()
    assert busy.proc.returncode == -signal.SIGKILL and time.perf_counter() - t < 5
    done = worker([sys.executable, "-c", "import time; time.sleep(0.5)"], finished=True)
    done.close()
    assert done.proc.returncode == 0 and done.err.closed  # exited on its own


def test_steal_is_read_from_proc_stat(tmp_path):
    from shram_static.bench.readings import cpu_times, steal_fraction
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 20 300 5 0 1 74 0 0\ncpu0 50 0 10 150 2 0 1 37 0 0\n")
    before = cpu_times(str(stat))
    assert before == (74, 500)
    stat.write_text("cpu  160 0 30 330 5 0 1 174 0 0\n")
    assert steal_fraction(before, cpu_times(str(stat))) == 0.5  # 100 of 200 ticks
    assert cpu_times(str(tmp_path / "none")) is None and steal_fraction(None, before) is None
    stat.write_text("intr 1 2 3\n")
    assert cpu_times(str(stat)) is None


def test_bandwidth_readings_of_two_memory_speeds_are_flagged():
    """Readings within 1.5x of each other are noise (no warning); further apart, the run met two
    memory speeds and says so, with the spread."""
    from shram_static.bench.readings import bandwidth_spread
    assert bandwidth_spread([35e9, 37e9, 41e9, 52e9]) is None
    assert bandwidth_spread([]) is None
    msg = bandwidth_spread([36.6e9, 67.8e9, 71.4e9])
    assert msg is not None and "spread 2.0x" in msg and "1.5x" in msg

def test_contexts_span_to_near_capacity():
    assert contexts(1024, 32) == [64, 256, 512, 768, 991]
    assert contexts(100, 8) == [25, 50, 64, 75, 91]


@pytest.mark.heavy
def test_bench_command_writes_json_and_plot(tmp_path, capsys, monkeypatch):
    """The command in this process (its workers are subprocesses, as always): one interpreter
    start fewer than `python -m shram_static bench`; tests/test_cli.py runs the module entry point
    (`generate`), which dispatches every command alike. Its bandwidth readings alternate between
    two speeds here (20 and 40 GB/s, not measured: real readings on a loaded machine can spread
    as far on their own), which the run warns of."""
    import itertools

    from shram_static.cli import main

    speeds = itertools.cycle([20e9, 40e9])
    monkeypatch.setattr(bench_mod, "measure_bandwidth", lambda x=None, reps=5: next(speeds))

    ckpt = tmp_path / "ckpt"
    # one layer, capacity 128, one round: the command's plumbing, not the model, is under test
    # (rounds interleave in test_measurements_interleave_backends_round_by_round)
    cfg = ShramConfig(**dict(TINY_CONFIG, num_decoder_layers=1, training_sequence_length=128))
    randomize_(ShramForCausalLM(cfg), 0).save_pretrained(ckpt)
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    code = main(["bench", "--models", str(ckpt), "--backends", "eager", "--batch-sizes", "1", "2",
                 "--steps", "2", "--rounds", "1", "--prefill-chunk", "8", "--capacity", "96", "--depths", "16", "40",
                 "--json", str(out), "--plot", str(png)])
    p = capsys.readouterr()
    assert code == 0, p.err[-2000:]
    res = json.loads(out.read_text())
    assert res["bandwidth_bytes_s"] > 0 and [r["batch"] for r in res["results"]] == [1, 2]
    assert res["steal_fraction"] is None or 0 <= res["steal_fraction"] <= 1
    for r in res["results"]:
        assert [q["context"] for q in r["points"]] == [16, 40] and r["capacity"] == 96
        assert all(q["decode_ms"] > 0 and q["x_floor"] > 0 and q["x_compiled"] is None for q in r["points"])
        assert all(q["decode_ms_best"] > 0 and q["x_compiled_best"] is None for q in r["points"])
        assert r["floor_ms"] > 0
        # the worker's own peak (it never holds the parent's 1 GiB bandwidth buffer)
        assert 0 < r["peak_rss_mib"] < 1024, r["peak_rss_mib"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "eager B=1" in p.out and "eager B=2" in p.out
    assert "warning: the bandwidth readings spread" in p.out


def test_bench_rejects_an_unknown_model(capsys, tmp_path):
    from shram_static.cli import main
    assert main(["bench", "--models", "no_such_model", "--backends", "eager"]) == 2
    assert main(["bench", "--models", str(tmp_path), "--backends", "eager"]) == 2  # no config.json
    assert "config.json" in capsys.readouterr().err
    assert main(["bench", "--models", "bench", "--backends", "eager", "--rounds", "0"]) == 2
