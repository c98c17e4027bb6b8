"""Where a .pte decode step spends its time, from a sampling profile of the runtime (`perf`).

The pip runtime is built without ExecuTorch's event tracer (`enable_etdump=True` writes nothing:
"No etdump data found, try rebuilding with ... EXECUTORCH_ENABLE_EVENT_TRACER"), so per-kernel
times come from `perf record` over a decode loop instead, grouped by symbol.

    python export/probes/probe_perf.py export DIR [--layers 12] [--quantize int8] [--batch-size 4]
    perf record -F 2000 -g -o DIR/perf.data -- python export/probes/probe_perf.py run DIR/model.pte
    perf report -i DIR/perf.data --no-children --sort symbol --stdio | head -60
"""

import argparse
import os
import time

import torch


def export(out: str, layers: int, quantize, batch_size: int = 1) -> None:
    from shram_static import ShramConfig, ShramForCausalLM
    from shram_static.bench import BENCH_CONFIG
    from shram_static.export.pte import export_pte

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ShramForCausalLM(ShramConfig(**dict(BENCH_CONFIG, num_decoder_layers=layers))).eval()
    os.makedirs(out, exist_ok=True)
    t = time.time()
    export_pte(model, os.path.join(out, "model.pte"), batch_size=batch_size, prefill_chunk=None, quantize=quantize)
    print(f"exported {layers} layers in {time.time() - t:.0f} s")


def run(path: str, ctx: int, seconds: float) -> None:
    """Decode steps through `load_pte` (what the benchmark times), after a prompt of `ctx`."""
    from shram_static.export import load_pte

    dec = load_pte(path)
    gen = torch.Generator().manual_seed(0)
    S = dec.config.inference_sequence_length
    ids = torch.randint(0, dec.config.vocab_size, (dec.batch_size, S), generator=gen)
    dec.prefill(ids[:, :ctx])
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and ctx + n < S:
        dec.decode(ids[:, ctx + n])
        n += 1
    print(f"{(time.perf_counter() - t0) / n * 1e3:.2f} ms/step over {n} steps")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("out")
    e.add_argument("--layers", type=int, default=12)
    e.add_argument("--quantize", default=None)
    e.add_argument("--batch-size", type=int, default=1)
    r = sub.add_parser("run")
    r.add_argument("path")
    r.add_argument("--ctx", type=int, default=64)
    r.add_argument("--seconds", type=float, default=8.0)
    a = ap.parse_args()
    export(a.out, a.layers, a.quantize, a.batch_size) if a.cmd == "export" else run(a.path, a.ctx, a.seconds)


if __name__ == "__main__":
    main()
