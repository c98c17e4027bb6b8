"""Shared test helpers: random small configs, randomised weights, golden cases, the oracle.

Imported by several test modules (keep these names): `random_config`, `randomize_`,
`golden_case`, plus `oracle_cfg`/`oracle_sd`/`run_oracle` to evaluate tests/oracle.py on a
model built by the package.
"""

import contextlib
import importlib.util
import os
import pathlib
import random
import sys
import unittest.mock

import pytest
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from oracle import CONFIG_DEFAULTS, oracle_forward  # noqa: E402

from shram_static import ShramConfig, ShramForCausalLM  # noqa: E402

DATA = os.path.join(HERE, "data")
GOLDEN_CASES = ["main_basic", "semantic_tied", "yarn_extended", "left_padded"]

# L -> the K that give W = L // K in {1, 2, 3, 4}
_SPARSE_SHAPES = {4: (4, 2, 1), 6: (6, 3, 2), 8: (8, 4, 2), 12: (12, 6, 4, 3)}


def load_benchmark(name: str):
    """The module of `benchmarks/<name>.py` (a script, not a package), loaded from its file."""
    return load_script(f"benchmarks/{name}.py")


def load_script(path: str):
    """The module of a script of the repository (`path` from its root), loaded from its file."""
    path = pathlib.Path(__file__).parents[1] / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_config(seed: int, **overrides) -> ShramConfig:
    """A small random ShramConfig: every structural choice (sizes, W, rope mode, tying, gates,
    YaRN extension) drawn from `seed`; `overrides` replace any field (an overridden
    training_sequence_length also scales the drawn inference_sequence_length)."""
    rng = random.Random(seed)
    L = rng.choice(sorted(_SPARSE_SHAPES))
    train = rng.randint(16, 64)
    extend = rng.choice((1, 1, 2, 3, 4))  # inference = extend * training (YaRN when > 1)
    train = overrides.get("training_sequence_length", train)
    fields = dict(
        vocab_size=rng.randint(50, 120),
        embedding_width=rng.randint(16, 48),
        mlp_width=rng.randint(16, 64),
        num_decoder_layers=rng.randint(1, 3),
        num_sliding_window_heads=rng.randint(1, 4),
        num_mosrah_heads=L,
        num_selected_heads=rng.choice(_SPARSE_SHAPES[L]),
        head_dim=rng.choice((4, 8)),
        window_size=rng.randint(2, 9),
        rope_mode=rng.choice(("main_sequence", "semantic_sequence")),
        local_rope_theta=rng.choice((10000.0, 500.0)),
        mosrah_rope_theta=rng.choice((10000.0, 100.0)),
        training_sequence_length=train,
        inference_sequence_length=train * extend,
        tie_word_embeddings=rng.random() < 0.5,
        use_residual_gate=rng.random() < 0.5,
    )
    fields.update(overrides)
    return ShramConfig(**fields)


@torch.no_grad()
def randomize_(model: ShramForCausalLM, seed: int, gates=(0.3, 1.5), norm: float = 0.2,
               proj: float | None = 0.3) -> ShramForCausalLM:
    """Sets every parameter AND the residual-scale buffers to random nonzero values, so no
    sublayer is hidden: embedding normal(0, 1), projections `proj` * normal (normal /
    sqrt(fan_in) when `proj` is None), norms 1 + `norm` * normal, gates uniform(`gates`)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("residual_scale"))
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("residual_scale"):
            v = gates[0] + (gates[1] - gates[0]) * torch.rand(t.shape, generator=gen)
        elif name.endswith("norm.weight"):
            v = 1.0 + norm * torch.randn(t.shape, generator=gen)
        elif name == "embed_tokens.weight":
            v = torch.randn(t.shape, generator=gen)
        elif proj is None:  # (out, in) nn.Linear weights; (L, d, u) / (L, u, d) experts read dim -2
            v = torch.randn(t.shape, generator=gen) / (t.shape[-1] if t.dim() == 2 else t.shape[-2]) ** 0.5
        else:
            v = proj * torch.randn(t.shape, generator=gen)
        t.copy_(v.to(t.dtype))
    return model


def random_model(seed: int, **overrides) -> ShramForCausalLM:
    """`randomize_(ShramForCausalLM(random_config(seed, **overrides)), seed)` in eval mode."""
    return randomize_(ShramForCausalLM(random_config(seed, **overrides)), seed).eval()


# The config of the batch-1 compiled-decoder tests (test_compiled_decoder.py):
# their steps are the same graphs whatever the weights, so Inductor compiles them once and later
# tests load them from its cache. WHY: with a cold cache (a fresh CI machine) each config's
# prefill, decode and verify steps cost ~30 s of the suite.
COMPILED_CONFIG_SEED = 11


def compiled_test_model(seed: int) -> ShramForCausalLM:
    """A model of `random_config(COMPILED_CONFIG_SEED)` (one layer, 12 experts of which 3 are
    selected, tied embeddings, YaRN-extended), its weights drawn from `seed`, in eval mode."""
    return randomize_(ShramForCausalLM(random_config(COMPILED_CONFIG_SEED)), seed).eval()


# The export tests' model: the shape of the first built-in model (byte vocabulary, d=64, 2 layers,
# 8 experts of which 2 are selected, window 16, capacity 256), independent of whatever the
# package ships as its built-in model, so lowering time and recorded op counts stay put.
TINY_CONFIG = dict(vocab_size=259, embedding_width=64, mlp_width=192, num_decoder_layers=2,
                   num_sliding_window_heads=4, num_mosrah_heads=8, num_selected_heads=2,
                   head_dim=16, window_size=16, training_sequence_length=256)


def tiny_model(seed: int = 20240601, **overrides) -> ShramForCausalLM:
    """`TINY_CONFIG` (with `overrides`) and the first built-in model's seeded weights, bit for bit
    without overrides: projections normal / sqrt(fan_in), embedding normal(0, 1), norms
    1 + 0.1 * normal, residual gates uniform(0.5, 1.5)."""
    with torch.random.fork_rng(devices=[]):  # the constructor's init draws from the global RNG
        model = ShramForCausalLM(ShramConfig(**dict(TINY_CONFIG, **overrides)))
    return randomize_(model, seed, gates=(0.5, 1.5), norm=0.1, proj=None).eval()


def random_ids(config: ShramConfig, batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=gen)


def golden_case(name: str) -> tuple[ShramForCausalLM, dict]:
    """(model loaded from tests/data/NAME, its golden tensors)."""
    path = os.path.join(DATA, name)
    return ShramForCausalLM.from_pretrained(path), load_file(os.path.join(path, "golden.safetensors"))


def oracle_cfg(config: ShramConfig) -> dict:
    """The plain dict tests/oracle.py reads (the fields of docs/design.md, "Config", only)."""
    return {k: getattr(config, k) for k in CONFIG_DEFAULTS}


def oracle_sd(model: ShramForCausalLM) -> dict:
    """The model's checkpoint tensors in float64, for tests/oracle.py."""
    return {k: v.detach().double() for k, v in model.state_dict().items()}


def run_oracle(model: ShramForCausalLM, ids: torch.Tensor, mask: torch.Tensor | None = None):
    """(logits float64 (B, N, V), selected (layers, B, N, K)) of the float64 reference."""
    return oracle_forward(oracle_cfg(model.config), oracle_sd(model), ids, mask)


def golden_run(dec, g):
    """Prefill in two calls (the second starting mid routing block), teacher-forced decode to
    the end, then greedy generation; returns (max abs logit error on live positions, tokens)."""
    ids, mask, P = g["input_ids"], g["attention_mask"].bool(), int(g["prompt_len"])
    W = dec.config.block_length
    # split point: row 0 has a live count that is not a multiple of W (mid block) when W > 1
    s = next((s for s in range(P // 2, P) if int(mask[0, :s].sum()) % W), P // 2)
    dec.reset()
    parts = [dec.prefill(ids[:, :s], mask[:, :s]), dec.prefill(ids[:, s:P], mask[:, s:P])]
    for t in range(P, ids.shape[1]):
        parts.append(dec.decode(ids[:, t], mask[:, t])[:, None])
    logits = torch.cat(parts, dim=1)
    err = (logits - g["logits_full"])[mask].abs().max().item()
    tokens = dec.generate(ids[:, :P], mask[:, :P], max_new_tokens=g["greedy_tokens"].shape[1])
    return err, tokens


@contextlib.contextmanager
def recorded_builds():
    """Within the block, the list it yields gets the kernels of each batch of C++ builds
    (`accelerators.kernel_builds._Batch._build`'s result) as the batch is built."""
    from shram_static.accelerators import kernel_builds

    batches, build = [], kernel_builds._Batch._build

    def record(batch):
        batches.append(build(batch))
        return batches[-1]
    with unittest.mock.patch.object(kernel_builds._Batch, "_build", record):
        yield batches


@contextlib.contextmanager
def counting_traces():
    """Within the block, the list it yields gets "export" for each `torch.export.export` and
    "decompose" for each `ExportedProgram.run_decompositions`."""
    traces = []
    export, decompose = torch.export.export, torch.export.ExportedProgram.run_decompositions
    with unittest.mock.patch.object(torch.export, "export", lambda *a, **k: traces.append("export") or export(*a, **k)), \
            unittest.mock.patch.object(torch.export.ExportedProgram, "run_decompositions",
                                       lambda *a, **k: traces.append("decompose") or decompose(*a, **k)):
        yield traces


@contextlib.contextmanager
def lowering_work(ours_module, ours_program):
    """Counts what a `.pte` lowering does inside the block; yields a dict of lists:
    "traces" (one entry per trace of our graph: `torch.export.export` of a module
    `ours_module` accepts, `ExportedProgram.run_decompositions` of a program `ours_program`
    accepts, `one_trace.export_decomposed`) and "passes" (the class name of every outermost fx
    graph pass run). The patches wrap the stock functions and are undone on exit."""
    from torch.fx.passes.infra.pass_base import PassBase

    from shram_static.accelerators import one_trace

    work = {"traces": [], "passes": []}
    decompose, export = torch.export.ExportedProgram.run_decompositions, torch.export.export
    one, run_pass, depth = one_trace.export_decomposed, PassBase.__call__, []

    def outermost(self, gm):
        if not depth:
            work["passes"].append(type(self).__name__)
        depth.append(1)
        try:
            return run_pass(self, gm)
        finally:
            depth.pop()

    traced = lambda: work["traces"].append(1)
    with contextlib.ExitStack() as stack:
        patch = lambda obj, name, fn: stack.enter_context(unittest.mock.patch.object(obj, name, fn))
        patch(torch.export.ExportedProgram, "run_decompositions",
              lambda self, *a, **k: (traced() if ours_program(self) else None) or decompose(self, *a, **k))
        patch(torch.export, "export",
              lambda mod, *a, **k: (traced() if ours_module(mod) else None) or export(mod, *a, **k))
        patch(one_trace, "export_decomposed", lambda *a, **k: traced() or one(*a, **k))
        patch(PassBase, "__call__", outermost)
        yield work


# The lowering accelerators (every one `accelerators.lowering()` and `export_and_lower` apply).
LOWERING_ACCELERATORS = ("one_trace_lowering", "needed_xnnpack_passes", "needed_edge_passes",
                         "one_edge_conversion_trace", "linear_partitioning", "lazy_recompiles")


def check_verify_step(dec, model) -> None:
    """An exported decoder with a verify step of 4 tokens (`verify_len=4`) against the eager
    `StaticDecoder`: verify, a per-row rollback, decode, and speculative greedy generation
    (prompt lookup) equal to plain greedy's tokens."""
    from shram_static import StaticDecoder

    B = dec.batch_size
    assert dec.rollback_limit == 4 and dec.verify_len == 4
    ref = StaticDecoder(model, B, dec.prefill_chunk, verify_len=4)
    dec.reset()
    ids = random_ids(model.config, B, 14, seed=3)
    ids = torch.cat([ids, ids[:, :6]], 1)  # an opening that repeats: prompt lookup finds guesses
    for d in (dec, ref):
        d.prefill(ids[:, :9], last_only=True)
    torch.testing.assert_close(dec.verify(ids[:, 9:13]), ref.verify(ids[:, 9:13]), atol=1e-4, rtol=1e-4)
    back = torch.arange(B) % 4  # each row forgets 0..3 of the 4 tokens
    dec.rollback(back)
    ref.rollback(back)
    torch.testing.assert_close(dec.decode(ids[:, 5]), ref.decode(ids[:, 5]), atol=1e-4, rtol=1e-4)
    want = ref.generate(ids, max_new_tokens=24)
    assert torch.equal(dec.generate(ids, max_new_tokens=24, speculate=3), want)


def check_last_token_prefill(dec, model) -> None:
    """An exported decoder whose prefill step returns each row's last live token's logits only
    (the export default, `full_logits=False`; 2 or more rows, prefill chunk 4, a verify step of 4
    tokens) against the eager `StaticDecoder`'s full logits: the last token's logits of rows
    that end in different chunks, one with holes; a verify step of C tokens (routed to the
    verify step, not to the last-token prefill); greedy generation. Asking for every token's
    logits raises a ValueError naming `full_logits` and changes nothing."""
    from shram_static import StaticDecoder

    B = dec.batch_size
    assert not dec.full_logits and dec.prefill_chunk == 4 and dec.verify_len == 4 and B >= 2
    ref = StaticDecoder(model, B, 4, verify_len=4)
    ids = random_ids(model.config, B, 11, seed=5)
    live = torch.ones(B, 11, dtype=torch.bool)
    live[1, 6:] = False  # row 1 ends in the second chunk ...
    live[1, 2] = False  # ... with a hole
    full = ref.prefill(ids, live)  # (B, 11, V)
    want = full[:, 10].clone()
    want[1] = full[1, 5]
    torch.testing.assert_close(dec.prefill(ids, live, last_only=True), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(dec.live_counts, ref.live_counts)
    with pytest.raises(ValueError, match="full_logits"):
        dec.prefill(ids[:, :3])
    with pytest.raises(ValueError, match="full_logits"):
        dec.step(ids[:, :4], torch.ones(B, 4, dtype=torch.bool))
    assert torch.equal(dec.live_counts, ref.live_counts)  # nothing ran
    torch.testing.assert_close(dec.verify(ids[:, :4]), ref.verify(ids[:, :4]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dec.step(ids[:, 4:8], torch.ones(B, 4, dtype=torch.bool), last_only=True),
                               ref.prefill(ids[:, 4:8])[:, -1:], atol=1e-4, rtol=1e-4)
    prompt = torch.cat([ids, ids[:, :5]], 1)
    want = ref.generate(prompt, max_new_tokens=12)
    assert torch.equal(dec.generate(prompt, max_new_tokens=12), want)
    assert torch.equal(dec.generate(prompt, max_new_tokens=12, speculate=3), want)


def fed_prefixes(dec, monkeypatch) -> list[tuple[int, int]]:
    """A list that collects, for each step `dec` (an exported decoder) runs from now on, (the
    most live tokens a row holds after it, the prefix length P of the slots it was fed)."""
    from shram_static.state import PrefixSlots

    fed, real = [], PrefixSlots.__call__

    def spy(self, input_pos, chunk):
        slots = real(self, input_pos, chunk)
        if self is dec._slots:  # the runner's, not an eager decoder's
            fed.append((int(input_pos.max()) + chunk, slots.shape[0]))
        return slots
    monkeypatch.setattr(PrefixSlots, "__call__", spy)
    return fed


def check_prefix_steps(dec, model, monkeypatch, lengths=(4, 8)) -> None:
    """An exported decoder whose steps attend a prefix of the sparse caches (exported with
    `prefix_lengths=lengths`; 3 rows, prefill chunk 4, W = 4, T = 20) against the eager
    `StaticDecoder`: rows at different depths, the deepest restarted, every step's logits
    within 1e-5, and the length the runner fed each step the shortest of `lengths` + (T,) that
    holds ceil(count / W) slots (count: the most live tokens a row holds after the step), each
    length at least once."""
    from shram_static import StaticDecoder

    cfg = model.config
    W, T, B = cfg.block_length, cfg.mosrah_cache_length, dec.batch_size
    assert (W, T, B, dec.prefill_chunk) == (4, 20, 3, 4)
    all_lengths = (*lengths, T)
    fed = fed_prefixes(dec, monkeypatch)
    dec.reset()
    ref = StaticDecoder(model, B, 4)
    ids = random_ids(cfg, B, 48, seed=7)
    mask = torch.zeros(B, 44, dtype=torch.bool)
    mask[0], mask[1, 30:], mask[2, 42:] = True, True, True  # 44, 14 and 2 tokens deep
    got = [(dec.prefill(ids[:, :44], mask, last_only=True), ref.prefill(ids[:, :44], mask, last_only=True))]
    for d in (dec, ref):
        d.reset_rows([0])  # the deepest row starts again: the others set the length
    for t in range(4):
        got.append((dec.decode(ids[:, 44 + t]), ref.decode(ids[:, 44 + t])))
    for a, b in got:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    want = [min(p for p in all_lengths if p * W >= count) for count, _ in fed]
    assert [p for _, p in fed] == want, fed
    assert set(want) == set(all_lengths), fed


# Portable kernels an exported program may call (test_export_pte.py's shared program, the
# quantized programs of test_export_quantized.py; everything else is inside the XNNPACK
# delegate). A new kernel here must be deliberate: check it exists in the runtime
# (`Runtime.get().operator_registry`) of the phones/boards you deploy to.
ALLOWED_KERNELS = {
    "aten::add.out", "aten::amax.out", "aten::any.out", "aten::arange.start_out",
    "aten::bitwise_and.Tensor_out", "aten::bitwise_not.out", "aten::bitwise_or.Tensor_out",
    "aten::cat.out", "aten::clamp.out", "aten::copy_", "aten::cumsum.out", "aten::div.out_mode",
    "aten::embedding.out", "aten::eq.Scalar_out", "aten::eq.Tensor_out", "aten::expand_copy.out",
    "aten::full.out", "aten::full_like.out", "aten::gather.out", "aten::ge.Scalar_out",
    "aten::gt.Scalar_out", "aten::index.Tensor_out", "aten::index_put_", "aten::index_select.out",
    "aten::le.Tensor_out", "aten::lt.Scalar_out", "aten::mean.out", "aten::mm.out", "aten::mul.out",
    "aten::ne.Scalar_out", "aten::remainder.Scalar_out", "aten::scalar_tensor.out",
    "aten::select_copy.int_out", "aten::sub.out", "aten::sum.IntList_out", "aten::topk.values",
    "aten::unsqueeze_copy.out", "aten::where.self_out", "dim_order_ops::_to_dim_order_copy.out",
    # steps over a prefix of the sparse caches, P a dynamic size: the prefix of each cache
    # copied out, the sizes read and the views shaped at run time (ExecuTorch's prim ops)
    "aten::slice_copy.Tensor_out", "aten::sym_size.int", "executorch_prim::et_view.default",
}


def delegated_ops(et, method: str):
    """(op name, node) of every op inside the method's XNNPACK delegates, e.g. ("bmm", node)."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    for _, mod in et.exported_program(method).graph_module.named_children():
        if isinstance(mod, LoweredBackendModule):
            for node in mod.original_module.graph.nodes:
                if node.op == "call_function":
                    # an edge op prints as "<EdgeOpOverload: aten.sqrt.default>: schema = ..."
                    yield str(node.target).split(">")[0].split(".")[1], node


def needs(*names):
    """Skips a test of accelerators that are off here (another release, SHRAM_STATIC_STOCK):
    where they are off, the stock path runs and there is nothing of theirs to test."""
    from shram_static.accelerators import enabled
    off = [n for n in names if not enabled(n)]
    return pytest.mark.skipif(bool(off), reason=f"accelerators off here: {', '.join(off)}")


def program_ops(et_program, method: str) -> dict:
    """What one method of an emitted program runs, for graph checks and reports.

    Args:
        et_program: an `ExecutorchProgramManager` (from `to_executorch`).
        method: method name.

    Returns:
        {"kernels": {"aten::op.overload": calls} (portable kernels, outside any delegate),
         "delegate_calls": int, "delegated_ops": int (edge ops inside the delegates),
         "backends": sorted backend ids}.
    """
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    plan = next((p for p in et_program.executorch_program.execution_plan if p.name == method), None)
    if plan is None:
        raise KeyError(f"no method {method!r} in the program")
    names = [f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators]
    kernels: dict[str, int] = {}
    delegate_calls = 0
    for chain in plan.chains:
        for ins in chain.instructions:
            kind = type(ins.instr_args).__name__
            if kind == "KernelCall":
                op = names[ins.instr_args.op_index]
                kernels[op] = kernels.get(op, 0) + 1
            elif kind == "DelegateCall":
                delegate_calls += 1
    delegated, backends = 0, set()
    for _, mod in et_program.exported_program(method).graph_module.named_children():
        if isinstance(mod, LoweredBackendModule):
            backends.add(mod.backend_id)
            delegated += sum(n.op == "call_function" for n in mod.original_module.graph.nodes)
    return {"kernels": kernels, "delegate_calls": delegate_calls, "delegated_ops": delegated,
            "backends": sorted(backends)}
