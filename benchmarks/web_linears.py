"""One linear layer in onnxruntime-web's WASM (Node, one thread): float MatMul, int8
DynamicQuantizeMatMul and 4-bit MatMulNBits at one row, the kernels a quantized page could run.

    python benchmarks/web_linears.py [--shapes 512x1536,512x50277] [--runs 100] [--rounds 6]
        [--chain N] [--threads T] [--kinds fp32,int8,int4]

`--chain N`: a graph of N linears one after another, each with weights of its own, so that a run
streams its weights from memory as a decode step does. Needs `npm ci` (onnxruntime-web). Prints
each kernel's median microseconds per call over rounds that alternate between the kernels.
"""

import argparse
import os
import subprocess
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = """
import * as ort from "%s";
import fs from "fs";
ort.env.wasm.numThreads = Number(process.env.WASM_THREADS || 1);
const [dir, runs, rounds, ...names] = process.argv.slice(2);
const runners = [];
for (const name of names) {
  const s = await ort.InferenceSession.create(fs.readFileSync(`${dir}/${name}.onnx`),
      {executionProviders: ["wasm"]});
  const k = Number(name.split("_")[1].split("x")[0]);
  const x = new ort.Tensor("float32", Float32Array.from({length: k}, (_, i) => Math.sin(i)), [1, k]);
  for (let i = 0; i < 20; i++) await s.run({x});
  runners.push({name, s, x, us: []});
}
for (let r = 0; r < Number(rounds); r++) {  // interleaved: memory bandwidth drifts between runs
  for (const m of (r %% 2 ? [...runners].reverse() : runners)) {
    const t0 = performance.now();
    for (let i = 0; i < Number(runs); i++) await m.s.run({x: m.x});
    m.us.push((performance.now() - t0) / Number(runs) * 1000);
  }
}
for (const m of runners) {
  const us = [...m.us].sort((a, b) => a - b);
  console.log(`${m.name}\tmedian ${us[us.length >> 1].toFixed(1)} us\t(${m.us.map(v => v.toFixed(0)).join(" ")})`);
}
"""


def linear_model(kind: str, k: int, n: int, chain: int = 1) -> onnx.ModelProto:
    """y = x @ W for a random (k, n) W, as `kind` stores and multiplies it; with chain > 1, that
    many linears one after another, (k, n) then (n, k) and so on, each with weights of its own
    (so that a run streams them from memory, as a decode step does)."""
    rng, nodes, inits, x = np.random.default_rng(0), [], [], "x"
    for i in range(chain):
        a, b = (k, n) if i % 2 == 0 else (n, k)
        w = (rng.standard_normal((a, b)) * 0.05).astype(np.float32)
        y = "y" if i == chain - 1 else f"h{i}"
        if kind == "int8":  # per-output scale, int8 activations quantized by the op
            s = (np.abs(w).max(0) / 127).astype(np.float32)
            inits += [numpy_helper.from_array(np.round(w / s).astype(np.int8), f"W{i}"),
                      numpy_helper.from_array(s, f"S{i}")]
            nodes.append(helper.make_node("DynamicQuantizeMatMul", [x, f"W{i}", f"S{i}"], [y], domain="com.microsoft"))
        else:
            inits.append(numpy_helper.from_array(w, f"W{i}"))
            nodes.append(helper.make_node("MatMul", [x, f"W{i}"], [y]))
        x = y
    out = n if chain % 2 else k
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    if kind == "int4":  # as the package's int4 exports: MatMulNBits in blocks of 32
        from shram_static.export.onnx_quantize import quantize_graph
        model = quantize_graph(model, "int4")[0]
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="512x1536,512x50277")
    p.add_argument("--runs", type=int, default=100, help="calls per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--chain", type=int, default=1, help="linears per graph, each with weights of its own")
    p.add_argument("--threads", type=int, default=1, help="WASM threads")
    p.add_argument("--kinds", default="fp32,int8,int4")
    a = p.parse_args()
    ort_web = os.path.join(ROOT, "node_modules", "onnxruntime-web", "dist", "ort.node.min.mjs")
    with tempfile.TemporaryDirectory() as d:
        names = []
        for shape in a.shapes.split(","):
            k, n = map(int, shape.split("x"))
            for kind in a.kinds.split(","):
                names.append(f"{kind}_{k}x{n}")
                onnx.save(linear_model(kind, k, n, a.chain), os.path.join(d, names[-1] + ".onnx"))
        with open(os.path.join(d, "run.mjs"), "w") as f:
            f.write(RUNNER % ort_web)
        subprocess.run(["node", os.path.join(d, "run.mjs"), d, str(a.runs), str(a.rounds), *names], check=True,
                       env={**os.environ, "WASM_THREADS": str(a.threads)})


if __name__ == "__main__":
    main()
