"""Probe: how much of an `.onnx` decode step is its weight matmuls, against compiled torch and
the floor, in one process.

Builds an ONNX graph of the bench model's 121 weight matmuls alone (per layer: local q, k, v, o,
the router, the fused experts' qkv and o over all L experts, gate, up, down; then the lm_head),
each on its own (1, 1, d) input, and times it beside the real decode graph (`export_onnx`,
decode only) and compiled torch, alternating 16-step medians; the floor is read between
rounds (`shram_static.bench`).

Run: python export/probes/probe_onnx_matmuls.py DIR [ROUNDS]   (DIR: where the .onnx files go)
"""

import os
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from shram_static import ShramConfig, ShramForCausalLM, StaticDecoder
from shram_static.bench import BENCH_CONFIG, decode_read_bytes, measure_bandwidth
from shram_static.export import export_onnx, load_onnx


def matmul_graph(path: str) -> ort.InferenceSession:
    c = BENCH_CONFIG
    d, hu, L, u, f = (c["embedding_width"], c["num_sliding_window_heads"] * c["head_dim"],
                      c["num_mosrah_heads"], c["head_dim"], c["mlp_width"])
    shapes = [(d, hu)] * 3 + [(hu, d), (d, L), (d, 3 * L * u), (L * u, d), (d, f), (d, f), (f, d)]
    shapes = shapes * c["num_decoder_layers"] + [(d, c["vocab_size"])]
    rng = np.random.default_rng(0)
    ins = {k: helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, 1, k]) for k in {a for a, _ in shapes}}
    inits, nodes, outs = [], [], []
    for i, (a, b) in enumerate(shapes):
        inits.append(numpy_helper.from_array(rng.standard_normal((a, b), dtype=np.float32) * 0.02, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{a}", f"w{i}"], [f"y{i}"]))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 1, b]))
    graph = helper.make_graph(nodes, "matmuls", list(ins.values()), outs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path,
              save_as_external_data=True, location=os.path.basename(path) + ".data")
    print(f"{len(shapes)} matmuls, {sum(a * b for a, b in shapes) * 4 / 1e6:.0f} MB")
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def main(out: str, rounds: int) -> None:
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = ShramForCausalLM(ShramConfig(**BENCH_CONFIG)).eval()
    sess = matmul_graph(os.path.join(out, "matmuls.onnx"))
    rng = np.random.default_rng(0)
    feed = {i.name: rng.standard_normal(i.shape, dtype=np.float32) for i in sess.get_inputs()}
    onnx_dec = load_onnx(export_onnx(model, os.path.join(out, "m.onnx"), prefill_chunk=None)["decode"])
    comp = StaticDecoder(model, batch_size=1, compile=True)
    comp.prefill_step = comp._prefill_step  # only the decode step is timed
    ids = torch.randint(0, model.config.vocab_size, (1, 2000), generator=torch.Generator().manual_seed(0))
    onnx_dec.prefill(ids[:, :8])
    comp.prefill(ids[:, :8])
    x, read = torch.ones(2**28), decode_read_bytes(model, 1, 32)

    def median_ms(fn):
        ts = []
        for i in range(16):
            t = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t)
        return 1e3 * statistics.median(ts)

    res = {"floor": [], "onnx matmuls": [], "onnx step": [], "compiled step": []}
    for r in range(rounds):
        tok = lambda i: ids[:, 8 + (r * 16 + i) % 1900]  # noqa: E731
        res["floor"].append(1e3 * read / measure_bandwidth(x))
        res["onnx matmuls"].append(median_ms(lambda i: sess.run(None, feed)))
        res["onnx step"].append(median_ms(lambda i: onnx_dec.decode(tok(i))))
        res["compiled step"].append(median_ms(lambda i: comp.decode(tok(i))))
        print("  ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()), flush=True)
    print("medians (ms):", {k: round(statistics.median(v), 2) for k, v in res.items()})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12)
