"""Throughput benchmark: `shram-static bench` (or `python -m shram_static.bench`).

For each model (the issue's bench config and the built-in model), backend (eager,
compiled) and batch size it reports prefill and decode tokens per second at context 64 and
near capacity, compile time and peak memory, next to the machine's floor: the bytes a decode
step must read divided by the memory read bandwidth measured here. Each configuration runs in
its own subprocess so its peak RSS and compile caches are its own.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

BENCH_CONFIG = dict(vocab_size=50277, embedding_width=512, mlp_width=1366, num_decoder_layers=12,
                    num_sliding_window_heads=16, num_mosrah_heads=16, num_selected_heads=4,
                    head_dim=16, window_size=128, training_sequence_length=1024,
                    inference_sequence_length=2048)


def build_model(name: str):
    from .config import ShramConfig
    from .model import ShramForCausalLM
    if name == "builtin":
        from .default_model import default_model
        return default_model()
    if name == "bench":
        torch.manual_seed(0)
        return ShramForCausalLM(ShramConfig(**BENCH_CONFIG))
    raise ValueError(f"unknown model {name!r}: use 'bench' or 'builtin'")


def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Best-of-`reps` read bandwidth in bytes/s of `torch.sum` over a buffer larger than cache."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def decode_read_bytes(model, batch_size: int, prefill_chunk: int) -> int:
    """Bytes one decode step must read: every weight but the embedding table (one row per
    row of the batch), the K selected experts' weights only, plus the cache rows attended."""
    cfg = model.config
    es = next(model.parameters()).element_size()
    n = sum(p.numel() for name, p in model.named_parameters() if name != "embed_tokens.weight")
    if model.lm_head is None:
        n += model.embed_tokens.weight.numel()  # tied: the lm_head reads the whole table
    bea = sum(p.numel() for name, p in model.named_parameters() if ".bea." in name)
    n -= bea - bea * cfg.num_selected_heads // cfg.num_mosrah_heads  # K of L experts
    n += batch_size * cfg.embedding_width
    ring = cfg.window_size + prefill_chunk - 1
    cache = 2 * batch_size * cfg.head_dim * (cfg.num_sliding_window_heads * ring
                                             + cfg.num_selected_heads * (cfg.mosrah_cache_length + 1))
    return (n + cfg.num_decoder_layers * cache) * es


def run_one(model_name: str, backend: str, batch_size: int, prefill_chunk: int, steps: int) -> dict:
    """Benchmarks one configuration in this process; returns a result dict."""
    from .decoder import StaticDecoder
    torch.manual_seed(0)
    model = build_model(model_name)
    cfg = model.config
    B, S = batch_size, cfg.inference_sequence_length
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=prefill_chunk, compile=backend == "compiled")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    t = time.perf_counter()
    dec.prefill(ids[:, :prefill_chunk])  # first calls compile (compiled backend)
    dec.decode(ids[:, 0])
    warm = time.perf_counter() - t
    res = dict(model=model_name, backend=backend, batch=B, chunk=prefill_chunk, warmup_s=round(warm, 2),
               read_bytes=decode_read_bytes(model, B, prefill_chunk), state_bytes=dec.state.nbytes())
    near = S - steps - 1
    for label, ctx in (("ctx64", 64), ("near_capacity", near)):
        dec.reset()
        n_prefill = ctx
        t = time.perf_counter()
        dec.prefill(ids[:, :n_prefill])
        tp = time.perf_counter() - t
        times = []
        for i in range(steps):
            t = time.perf_counter()
            dec.decode(ids[:, n_prefill + i])
            times.append(time.perf_counter() - t)
        times.sort()
        med = times[len(times) // 2]
        res[label] = dict(context=ctx, prefill_tok_s=round(B * n_prefill / tp, 1),
                          decode_ms=round(1e3 * med, 3), decode_tok_s=round(B / med, 1))
    res["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return res


def _worker(args) -> None:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    print(json.dumps(run_one(args.model, args.backend, args.batch_size, args.prefill_chunk, args.steps)))


def bench(args) -> int:
    jobs = [(m, be, b) for m in args.models for be in args.backends for b in args.batch_sizes]
    bw = measure_bandwidth()
    print(f"memory read bandwidth (torch.sum over 1 GiB, {torch.get_num_threads()} threads): "
          f"{bw / 1e9:.1f} GB/s", flush=True)
    results = []
    for i, (m, be, b) in enumerate(jobs, 1):
        print(f"[{i}/{len(jobs)}] model={m} backend={be} batch={b} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "shram_static.bench", "--worker", "--model", m, "--backend", be,
               "--batch-size", str(b), "--prefill-chunk", str(args.prefill_chunk), "--steps", str(args.steps)]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if p.returncode != 0:
            print(f"  failed:\n{p.stderr[-2000:]}", file=sys.stderr)
            return 1
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["floor_ms"] = round(1e3 * r["read_bytes"] / bw, 3)
        results.append(r)
        print(f"  done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        print(format_row(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth_bytes_s=bw, results=results), f, indent=1)
    return 0


def format_row(r: dict) -> str:
    a, z = r["ctx64"], r["near_capacity"]
    return (f"{r['model']:>7} {r['backend']:>8} B={r['batch']}: "
            f"decode {a['decode_ms']:.2f} ms/step ({a['decode_tok_s']:.1f} tok/s) @ctx64, "
            f"{z['decode_ms']:.2f} ms/step @ctx{z['context']} | floor {r['floor_ms']:.2f} ms "
            f"({r['read_bytes'] / 1e6:.1f} MB) | prefill {a['prefill_tok_s']:.0f} tok/s @64, "
            f"{z['prefill_tok_s']:.0f} tok/s @{z['context']} | warm-up {r['warmup_s']:.1f} s | "
            f"state {r['state_bytes'] / 2**20:.1f} MiB | peak RSS {r['peak_rss_mib']:.0f} MiB")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["builtin", "bench"], choices=["builtin", "bench"])
    p.add_argument("--backends", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    p.add_argument("--json", help="also write the results to this JSON file")


def register(subparsers) -> None:
    """Adds the `bench` subcommand to the CLI."""
    p = subparsers.add_parser("bench", help="prefill/decode throughput, eager vs compiled, vs the bandwidth floor")
    add_arguments(p)
    p.set_defaults(func=bench)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m shram_static.bench", description=__doc__)
    add_arguments(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
