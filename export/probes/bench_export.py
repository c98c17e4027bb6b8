"""Throughput of the exported artifacts (.pte fp32, .pte int8, .onnx) on the bench config,
with the same protocol as `shram_static.bench` (prefill tok/s and median decode step at context
64 and near capacity, peak RSS), each artifact measured in its own subprocess.

Run:  python export/probes/bench_export.py --model bench --out /tmp/bench_export [--formats pte,int8,onnx]
Compare with: python -m shram_static.bench --models bench --backends compiled --batch-sizes 1
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def export_all(model_name, out, formats, chunk):
    from shram_static.bench import build_model
    from shram_static.export import export_onnx, export_pte
    model = build_model(model_name)
    os.makedirs(out, exist_ok=True)
    res = {}
    for fmt in formats:
        t = time.perf_counter()
        if fmt == "pte":
            path = export_pte(model, f"{out}/{model_name}.pte", batch_size=1, prefill_chunk=chunk)
            size = os.path.getsize(path)
        elif fmt == "int8":
            path = export_pte(model, f"{out}/{model_name}.int8.pte", batch_size=1, prefill_chunk=chunk, quantize="int8")
            size = os.path.getsize(path)
        else:
            paths = export_onnx(model, f"{out}/{model_name}.onnx", batch_size=1, prefill_chunk=chunk)
            path = paths["decode"]
            size = sum(os.path.getsize(p) for p in paths.values())
        res[fmt] = dict(path=path, export_s=round(time.perf_counter() - t, 1), file_mib=round(size / 2**20, 1))
        print(fmt, res[fmt], flush=True)
    return res


def measure(fmt, path, steps):
    from shram_static.export import load_onnx, load_pte
    t = time.perf_counter()
    # "onnx-alt": the same graphs with two alternating state sets instead of in-place binding
    dec = load_onnx(path, inplace=fmt == "onnx") if fmt.startswith("onnx") else load_pte(path)
    load_s = time.perf_counter() - t
    cfg = dec.config
    S = cfg.inference_sequence_length
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=gen)
    dec.prefill(ids[:, :dec.prefill_chunk])
    dec.decode(ids[:, 0])
    res = dict(format=fmt, load_s=round(load_s, 2))
    for label, ctx in (("ctx64", 64), ("near_capacity", S - steps - 1)):
        dec.reset()
        t = time.perf_counter()
        dec.prefill(ids[:, :ctx])
        tp = time.perf_counter() - t
        times = []
        for i in range(steps):
            t = time.perf_counter()
            dec.decode(ids[:, ctx + i])
            times.append(time.perf_counter() - t)
        times.sort()
        med = times[len(times) // 2]
        res[label] = dict(context=ctx, prefill_tok_s=round(ctx / tp, 1), decode_ms=round(1e3 * med, 2),
                          decode_tok_s=round(1 / med, 1))
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec from the (exporting) parent
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    res["peak_rss_mib"] = round(hwm / 1024, 1)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bench")
    p.add_argument("--out", default="/tmp/bench_export")
    p.add_argument("--formats", default="pte,int8,onnx")
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--skip-export", action="store_true")
    a = p.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], a.measure[1], a.steps)))
        return
    formats = a.formats.split(",")
    meta_path = f"{a.out}/{a.model}.export.json"
    if a.skip_export:
        exported = json.load(open(meta_path))
    else:
        exported = export_all(a.model, a.out, formats, a.chunk)
        json.dump(exported, open(meta_path, "w"), indent=1)
    for fmt in formats + (["onnx-alt"] if "onnx" in formats else []):
        e = exported[fmt.replace("-alt", "")]
        r = subprocess.run([sys.executable, __file__, "--measure", fmt, e["path"], "--steps", str(a.steps)],
                           capture_output=True, text=True)
        if r.returncode:
            print(fmt, "FAILED", r.stderr[-3000:])
            continue
        m = json.loads(r.stdout.strip().splitlines()[-1])
        m.update(e)
        print(json.dumps(m), flush=True)


if __name__ == "__main__":
    main()
