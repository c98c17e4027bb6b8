"""Probe 1: ExecuTorch recipe for a stateful two-method program (decode `forward` + `prefill`).

Run: python export/probes/probe_pte.py [--reinplace] [--no-share] [--no-init]
Proves: (a) both methods share mutable buffers through executorch.runtime; (b) a fresh program's
buffers start from the values stored by InitializedMutableBufferPass; (c) what the emitted
program does with in-place index_put_ (whole-buffer copy_ write-backs or not); (d) constant
methods incl. a string one.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from toy import ToyCore, ToyState, ToyStep  # noqa: E402

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from executorch.runtime import Runtime


class Decode(nn.Module):
    """forward(tokens [1,1], input_pos [1]) -> logits [1, V]  (stock-runner signature)."""

    def __init__(self, step):
        super().__init__()
        self.step = step  # same attribute name in both wrappers -> same buffer FQNs

    def forward(self, tokens, input_pos):
        live = torch.ones_like(tokens, dtype=torch.bool)
        return self.step(tokens, input_pos, live)[:, -1, :]


class Prefill(nn.Module):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def forward(self, tokens, input_pos, live):
        return self.step(tokens, input_pos, live)


class InitFirstMethodOnly(InitializedMutableBufferPass):
    """Mark buffers for initialisation in the FIRST method lowered only (dict order: forward).

    WHY: ExecuTorch stores a mutable buffer's initial bytes per method, so a shared cache marked in
    both methods is stored twice in the .pte.  The runtime copies them in when a method is LOADED,
    so loading `forward` once (always, it is the method every consumer loads) initialises the
    shared arena; `prefill` must then be loaded after it and carries no copy.
    """

    def __init__(self, patterns):
        super().__init__(patterns)
        self.calls = 0

    def call(self, graph_module):
        self.calls += 1
        if self.calls > 1:
            saved, self.patterns = self.patterns, []
            try:
                return super().call(graph_module)
            finally:
                self.patterns = saved
        return super().call(graph_module)


def build(path, C, share=True, init=True, reinplace=False, poison_init=False, T=24, d=32, init_first_only=False):
    core = ToyCore(T=T, d=d)
    state = ToyState(core, 1)
    if poison_init:  # make the stored initial values recognisable
        state.cache_k.fill_(0.5)
    step = ToyStep(core, state).eval()
    dec, pre = Decode(step), Prefill(step)
    with torch.no_grad():
        ep_d = torch.export.export(dec, (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)), strict=True)
        ep_p = torch.export.export(pre, (torch.zeros(1, C, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                         torch.ones(1, C, dtype=torch.bool)), strict=True)
    print("mutated buffers (decode):", ep_d.graph_signature.buffers_to_mutate)
    cfg = {"toy": True, "T": core.T, "nested": {"a": [1, 2]}}
    edge = to_edge_transform_and_lower(
        {"forward": ep_d, "prefill": ep_p},
        partitioner=[XnnpackPartitioner()],
        constant_methods={
            "get_max_seq_len": core.T,
            "get_max_context_len": core.T,
            "use_kv_cache": True,
            "enable_dynamic_shape": False,
            "get_eos_ids": [3],
            "get_config_json": json.dumps(cfg),                      # string constant method
            "get_config_bytes": torch.tensor(list(json.dumps(cfg).encode()), dtype=torch.uint8),
        },
    )
    names = [n for n in state.names()]
    init_pass = InitFirstMethodOnly(names) if init_first_only else InitializedMutableBufferPass(names)
    passes = [init_pass] if init else []
    et = edge.to_executorch(ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=share, alloc_graph_input=True),
        emit_mutable_buffer_names=True,
        run_reinplace_pass=reinplace,
        passes=passes,
    ))
    with open(path, "wb") as f:
        f.write(et.buffer)
    return step, et, state


def build_generic(path, C, V, T, eos_ids, d=32):
    """Toy program with vocabulary V (for the runner probe): same recipe, reinplace on."""
    core = ToyCore(V=V, T=T, d=d)
    state = ToyState(core, 1)
    step = ToyStep(core, state).eval()
    with torch.no_grad():
        ep_d = torch.export.export(Decode(step), (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)), strict=True)
        ep_p = torch.export.export(Prefill(step), (torch.zeros(1, C, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                                   torch.ones(1, C, dtype=torch.bool)), strict=True)
    edge = to_edge_transform_and_lower(
        {"forward": ep_d, "prefill": ep_p}, partitioner=[XnnpackPartitioner()],
        constant_methods={"get_max_seq_len": T, "get_max_context_len": T, "use_kv_cache": True,
                          "enable_dynamic_shape": False, "get_eos_ids": list(eos_ids)})
    et = edge.to_executorch(ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True), emit_mutable_buffer_names=True,
        run_reinplace_pass=True, passes=[InitializedMutableBufferPass(state.names())]))
    with open(path, "wb") as f:
        f.write(et.buffer)
    return step, et, state


def count_ops(et, method):
    """Count emitted operator calls (kernel names) and delegate calls in the executorch program."""
    prog = et.executorch_program
    for plan in prog.execution_plan:
        if plan.name != method:
            continue
        ops = [f"{o.name}.{o.overload}" for o in plan.operators]
        counts = {}
        ndel = 0
        for chain in plan.chains:
            for ins in chain.instructions:
                a = ins.instr_args
                if type(a).__name__ == "KernelCall":
                    counts[ops[a.op_index]] = counts.get(ops[a.op_index], 0) + 1
                elif type(a).__name__ == "DelegateCall":
                    ndel += 1
        return counts, ndel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reinplace", action="store_true")
    ap.add_argument("--no-share", action="store_true")
    ap.add_argument("--no-init", action="store_true")
    ap.add_argument("--T", type=int, default=24)
    ap.add_argument("--init-first-only", action="store_true")
    ap.add_argument("--d", type=int, default=32)
    a = ap.parse_args()
    C = 8
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "toy.pte")
    step, et, state = build(path, C, share=not a.no_share, init=not a.no_init, reinplace=a.reinplace,
                            poison_init=True, T=a.T, d=a.d, init_first_only=a.init_first_only)
    for m in ("forward", "prefill"):
        counts, ndel = count_ops(et, m)
        print(f"[{m}] delegate calls={ndel} kernels={counts}")
    print("size", os.path.getsize(path))

    rt = Runtime.get()
    prog = rt.load_program(path)
    print("methods", sorted(prog.method_names))
    for name in ("get_max_seq_len", "get_max_context_len", "use_kv_cache", "enable_dynamic_shape", "get_eos_ids",
                 "get_config_json", "get_config_bytes"):
        try:
            out = prog.load_method(name).execute([])
            if name == "get_config_bytes":
                out = bytes(out[0].tolist()).decode()
            print(f"  {name} -> {out!r}")
        except Exception as e:  # noqa: BLE001
            print(f"  {name} FAILED: {type(e).__name__}: {e}")
    fwd, pre = prog.load_method("forward"), prog.load_method("prefill")

    # eager reference on a fresh copy of the state (initial values as exported)
    state.cache_k.fill_(0.5); state.cache_v.zero_(); state.taken.zero_()
    torch.manual_seed(1)
    prompt = torch.randint(0, 64, (1, C))
    live = torch.ones(1, C, dtype=torch.bool); live[0, -2:] = False  # padded prompt
    with torch.no_grad():
        ref = [step(prompt, torch.tensor([0]), live)]
        toks = [5, 9, 11, 2, 7]
        p = int(live.sum())
        for t in toks:
            ref.append(step(torch.tensor([[t]]), torch.tensor([p]), torch.ones(1, 1, dtype=torch.bool))[:, -1])
            p += 1
    # first check a fresh program: decode at pos 0 reads nothing stale -> fine either way; instead
    # run prefill then decode and compare
    got = [pre.execute([prompt, torch.tensor([0]), live])[0]]
    p = int(live.sum())
    for t in toks:
        got.append(fwd.execute([torch.tensor([[t]]), torch.tensor([p])])[0]); p += 1
    err0 = (got[0] - ref[0])[live].abs().max().item()
    errs = [(g - r).abs().max().item() for g, r in zip(got[1:], ref[1:])]
    print(f"prefill err {err0:.2e}; decode-after-prefill errs {[f'{e:.1e}' for e in errs]}")
    print("SHARED" if max(errs) < 1e-4 else "NOT SHARED (decode did not see prefill state)")

    # a freshly loaded program: do its buffers start from the exported values? the toy reads
    # cache rows <= pos only, so probe with an eager step that starts from the 0.5-filled cache
    prog2 = rt.load_program(path)
    f2 = prog2.load_method("forward")
    # reads slot 0..3 without having written slots 1..3? no: mask hides them. Instead compare a
    # step at pos 3 without prior writes: slots 0..2 are read and hold the initial values
    state.cache_k.fill_(0.5); state.cache_v.zero_(); state.taken.zero_()
    with torch.no_grad():
        r = step(torch.tensor([[4]]), torch.tensor([3]), torch.ones(1, 1, dtype=torch.bool))[:, -1]
    g = f2.execute([torch.tensor([[4]]), torch.tensor([3])])[0]
    print(f"fresh-program initial-value check err {(g - r).abs().max().item():.2e} "
          f"(0 => buffers started at the exported values)")

    # does LOADING a method again re-initialise the shared state?  run forward at pos 3 (reads slots
    # 0..2 = initial values), write slot 0..2 via prefill, then load forward again and re-run.
    prog3 = rt.load_program(path)
    f3 = prog3.load_method("forward"); p3 = prog3.load_method("prefill")
    p3.execute([prompt, torch.tensor([0]), torch.ones(1, C, dtype=torch.bool)])
    a1 = f3.execute([torch.tensor([[4]]), torch.tensor([3])])[0]
    f3b = prog3.load_method("forward")
    a2 = f3b.execute([torch.tensor([[4]]), torch.tensor([3])])[0]
    print(f"re-loading forward after prefill changes state: {(a1 - a2).abs().max().item() > 1e-6} "
          f"(same as fresh-init: {(a2 - r).abs().max().item() < 1e-5})")
    p3b = prog3.load_method("prefill")
    a3 = f3b.execute([torch.tensor([[4]]), torch.tensor([3])])[0]
    print(f"re-loading prefill changes state: {(a3 - a2).abs().max().item() > 1e-6}")

    # speed
    t0 = time.perf_counter()
    for i in range(200):
        fwd.execute([torch.tensor([[1]]), torch.tensor([i % 20])])
    print(f"decode step {1e3 * (time.perf_counter() - t0) / 200:.3f} ms")


if __name__ == "__main__":
    main()
