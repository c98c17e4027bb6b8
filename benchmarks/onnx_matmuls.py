"""How much of an `.onnx` decode step its weight matmuls alone take in onnxruntime.

Builds a graph of nothing but the decode graph's MatMul / Gemm nodes that read a weight
(the same weights, shapes and node kinds, each fed a constant row, one output that keeps every
node alive), and times it against the full decode step in one process, interleaved round by
round, with the machine's read bandwidth (`readings.measure_bandwidth`) between rounds. The
matmul-only graph is what the step would cost if every other node were free: against the
bytes it reads it says how fast onnxruntime's fp32 GEMV streams the weights on this machine.

    python benchmarks/onnx_matmuls.py m.onnx [--rounds 6] [--steps 20]

`m.onnx` is a decode graph written by `shram-static export --format onnx` (or `export_onnx`);
with `--model bench|builtin` instead of a path, the model is exported to a temporary folder and
its compiled decode step (`StaticDecoder(compile=True)`) is timed in the same rounds too.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch


def decode_loop(dec, prompt: torch.Tensor):
    """A function running one decode step of `dec` (`HostDecoder`) after `prompt` (B, N) is
    prefilled, prefilling it again whenever a row nears capacity."""
    tok = torch.zeros(dec.batch_size, dtype=torch.long)
    dec.prefill(prompt, last_only=True)

    def step():
        dec.decode(tok)
        if dec.capacity - int(dec.live_counts.max()) < 2:
            dec.reset()
            dec.prefill(prompt, last_only=True)
    return step


def interleaved(runs: list, rounds: int, steps: int) -> tuple[dict, float, list]:
    """Times each (name, fn) of `runs` for `steps` calls per turn (after 3 untimed), all of them
    each round, the order reversed every other round, with the read bandwidth
    (`readings.measure_bandwidth`) measured after each round.

    Returns:
        ({name: median ms per call}, median bandwidth in bytes/s, the bandwidth readings).
    """
    from shram_static.bench.readings import measure_bandwidth

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t) / steps * 1e3

    times, bw = {name: [] for name, _ in runs}, []
    for r in range(rounds):
        for name, fn in runs if r % 2 == 0 else reversed(runs):
            times[name].append(ms(fn))
        bw.append(measure_bandwidth())
    return {name: statistics.median(v) for name, v in times.items()}, statistics.median(bw), bw


def matmul_graph(path: str, out_path: str) -> tuple[int, int]:
    """Writes to out_path the weight matmuls of the decode graph at path; returns (nodes,
    weight bytes)."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(path)  # with its external data: the weights are copied into the new graph
    inits = {i.name: i for i in m.graph.initializer}
    nodes, used, inputs, sums = [], {}, {}, []  # used: each weight read, once by name
    for n in m.graph.node:
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or n.input[1] not in inits:
            continue
        w = inits[n.input[1]]
        if w.data_type != TensorProto.FLOAT:
            raise SystemExit(f"{path}: weight {w.name} is not fp32 (this benchmark builds fp32 graphs)")
        trans_b = any(a.name == "transB" and a.i for a in n.attribute)
        k = w.dims[-1] if trans_b else w.dims[-2]
        x = inputs.setdefault(k, f"x{k}")
        y = f"y{len(sums)}"
        nodes.append(helper.make_node(n.op_type, [x, n.input[1]], [y], **({"transB": 1} if trans_b else {})))
        nodes.append(helper.make_node("ReduceSum", [y], [f"{y}.sum"], keepdims=1))
        sums.append(f"{y}.sum")
        used[w.name] = w
    if not sums:
        raise SystemExit(f"{path} has no MatMul or Gemm over a weight")
    nodes.append(helper.make_node("Concat", sums, ["out"], axis=-1))
    graph = helper.make_graph(
        nodes, "weight_matmuls",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, k]) for k, x in inputs.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], list(used.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, out_path, save_as_external_data=True, location=os.path.basename(out_path) + ".data")
    nbytes = sum(int(np.prod(w.dims)) * 4 for w in used.values())  # fp32, checked above
    return len(sums), nbytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", nargs="?", help="a decode graph m.onnx")
    p.add_argument("--model", help="bench, builtin or a checkpoint directory: export it first")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if bool(args.path) == bool(args.model):
        p.error("give either an exported m.onnx or --model")
    import onnxruntime as ort

    from shram_static.export import load_onnx

    tmp = tempfile.TemporaryDirectory()
    path, decoders = args.path, []
    if args.model:
        from shram_static.bench import build_model
        from shram_static.export import export_onnx
        path = os.path.join(tmp.name, "m.onnx")
        print(f"exporting {args.model} (decode graph only) ...", file=sys.stderr)
        model = build_model(args.model)
        export_onnx(model, path, prefill_chunk=None)
        from shram_static import StaticDecoder
        print("compiling its decode step ...", file=sys.stderr)
        decoders.append(("compiled", StaticDecoder(model, compile=True)))
    mm_path = os.path.join(tmp.name, "matmuls.onnx")
    count, nbytes = matmul_graph(path, mm_path)
    sess = ort.InferenceSession(mm_path, providers=["CPUExecutionProvider"])
    feed = {i.name: np.ones(i.shape, np.float32) for i in sess.get_inputs()}
    decoders.append(("onnx", load_onnx(path)))
    prompt = torch.zeros(decoders[0][1].batch_size, 64, dtype=torch.long)

    runs = [(name, decode_loop(dec, prompt)) for name, dec in decoders] + [("matmuls", lambda: sess.run(None, feed))]
    t, b, bw = interleaved(runs, args.rounds, args.steps)
    o, f = t["matmuls"], t["onnx"]
    floor = nbytes / b * 1e3
    print(f"{count} weight matmuls, {nbytes / 1e6:.1f} MB; read bandwidth {b / 1e9:.1f} GB/s (median of "
          f"{len(bw)}): their floor {floor:.2f} ms")
    print(f"matmuls alone in onnxruntime {o:.2f} ms ({nbytes / o / 1e6:.1f} GB/s, {o / floor:.2f}x their floor); "
          f"the .onnx decode step {f:.2f} ms: the matmuls are {o / f:.0%} of it")
    if "compiled" in t:
        c = t["compiled"]
        print(f"the compiled decode step {c:.2f} ms: the .onnx step {c / f:.2f}x its speed, the matmuls "
              f"alone {c / o:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
