"""Probe 4: ONNX export of the pure (state in -> state out) toy step, and onnxruntime IOBinding
with each present bound to its past's OrtValue (in-place state).

Run: python export/probes/probe_onnx.py
"""

import json
import os
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(__file__))
from toy import ToyCore, ToyFunctional, ToyState, ToyStep  # noqa: E402


def export_graph(fn, state, B, C, path, cfg):
    names = state.names()
    args = (torch.zeros(B, C, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.ones(B, C, dtype=torch.bool),
            *[getattr(state, n).clone() for n in names])
    with torch.no_grad():
        prog = torch.onnx.export(
            fn, args, dynamo=True, external_data=False, optimize=True,
            input_names=["input_ids", "position_ids", "live", *[f"past.{n}" for n in names]],
            output_names=["logits", *[f"present.{n}" for n in names]],
        )
    model = prog.model_proto
    # WHY metadata_props: ORT exposes them as session.get_modelmeta().custom_metadata_map
    onnx.helper.set_model_props(model, {"shram_config": json.dumps(cfg), "state_names": json.dumps(names)})
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return model


class OrtStepper:
    """Runs one graph with state kept in OrtValues; `inplace` binds present.X to past.X's OrtValue."""

    def __init__(self, path, names, state_init, inplace=True):
        so = ort.SessionOptions()
        self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.names = names
        self.inplace = inplace
        # keep the numpy arrays alive: OrtValue.ortvalue_from_numpy does not own them
        self._np = [np.ascontiguousarray(s.numpy().copy()) for s in state_init]
        self.state = [ort.OrtValue.ortvalue_from_numpy(a) for a in self._np]
        self._np2 = [a.copy() for a in self._np]
        self.state2 = [ort.OrtValue.ortvalue_from_numpy(a) for a in self._np2]

    def run(self, ids, pos, live):
        b = self.sess.io_binding()
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("position_ids", pos)
        b.bind_cpu_input("live", live)
        b.bind_output("logits")  # bound first: copy_outputs_to_cpu() follows binding order
        src = self.state
        dst = self.state if self.inplace else self.state2
        for n, s, d in zip(self.names, src, dst):
            b.bind_ortvalue_input(f"past.{n}", s)
            b.bind_ortvalue_output(f"present.{n}", d)
        self.sess.run_with_iobinding(b)
        if not self.inplace:  # alternate the two state sets: the output never aliases the input
            self.state, self.state2 = self.state2, self.state
        return b.copy_outputs_to_cpu()[0]


def main():
    B, C = 2, 8
    T, d = 24, 32
    for big in (False, True):
        if big:
            T, d = 16384, 64  # 4 MiB per cache: timing of in-place vs alternating
        core = ToyCore(T=T, d=d).eval()
        state = ToyState(core, B)
        fn = ToyFunctional(core, state).eval()
        tmp = tempfile.mkdtemp()
        cfg = {"toy": True, "T": T}
        paths = {}
        for tag, c in (("decode", 1), ("prefill", C)):
            paths[tag] = os.path.join(tmp, f"m.{tag}.onnx")
            model = export_graph(fn, state, B, c, paths[tag], cfg)
            ops = {}
            for n in model.graph.node:
                ops[n.op_type] = ops.get(n.op_type, 0) + 1
            print(f"[{tag}] inputs {[i.name for i in model.graph.input]} outputs {[o.name for o in model.graph.output]}")
            print(f"[{tag}] ops {ops} initializers {len(model.graph.initializer)} size {os.path.getsize(paths[tag])}")
        s = ort.InferenceSession(paths["decode"], providers=["CPUExecutionProvider"])
        print("metadata:", s.get_modelmeta().custom_metadata_map["shram_config"])

        # eager reference with the in-place module
        step = ToyStep(core, ToyState(core, B)).eval()
        torch.manual_seed(3)
        prompt = torch.randint(0, 64, (B, C))
        live = torch.ones(B, C, dtype=torch.bool); live[1, :3] = False   # row 1 left-padded
        with torch.no_grad():
            ref = [step(prompt, torch.zeros(B, dtype=torch.long), live)]
            pos = live.sum(1)
            toks = torch.randint(0, 64, (6, B, 1))
            for t in toks:
                ref.append(step(t, pos, torch.ones(B, 1, dtype=torch.bool))[:, -1]); pos = pos + 1
        init = [getattr(state, n) for n in state.names()]
        res = {}
        for inplace in (True, False):
            pre = OrtStepper(paths["prefill"], state.names(), init, inplace)
            dec = OrtStepper(paths["decode"], state.names(), init, inplace)
            out = [pre.run(prompt.numpy(), np.zeros(B, np.int64), live.numpy())]
            dec.state, dec.state2, dec._np, dec._np2 = pre.state, pre.state2, pre._np, pre._np2  # share state
            pos = live.sum(1).numpy()
            for t in toks:
                out.append(dec.run(t.numpy(), pos, np.ones((B, 1), bool))[:, -1]); pos = pos + 1
            e0 = np.abs(out[0] - ref[0].numpy())[live.numpy()].max()
            e = max(np.abs(o - r.numpy()).max() for o, r in zip(out[1:], ref[1:]))
            res[inplace] = out
            # timing of decode
            t0 = time.perf_counter()
            for i in range(50):
                dec.run(toks[0].numpy(), np.full(B, 10, np.int64), np.ones((B, 1), bool))
            ms = (time.perf_counter() - t0) / 50 * 1e3
            print(f"T={T} d={d} inplace={inplace}: prefill err {e0:.1e} decode err {e:.1e} decode {ms:.3f} ms/step")
        same = max(np.abs(a - b).max() for a, b in zip(res[True][1:], res[False][1:]))
        print(f"in-place vs alternating max diff {same:.1e}")


if __name__ == "__main__":
    main()
