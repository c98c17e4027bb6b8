"""Graph-break regression suite: the two static steps must stay whole, static graphs.

Each property has its own test so a regression names what broke: a graph break, a
recompile, a failed strict export, a data-dependent-shape op in the exported graph, or a
state buffer not updated in place.
"""

import functools
import unittest.mock

import pytest
import torch
from torch._inductor.async_compile import get_compile_threads
from torch._inductor.graph import GraphLowering

from helpers import random_config, randomize_, recorded_builds
from shram_static import ShramForCausalLM, StaticDecoder
from shram_static.accelerators import enabled

B, C = 2, 4

# Ops whose output shape or control flow depends on tensor data, or that read a value back to
# the host. Any of them in an exported step is a regression (no static shape, no export).
DENYLIST = {
    "aten.nonzero.default", "aten.nonzero_static.default", "aten.argwhere.default",
    "aten.masked_select.default", "aten.masked_scatter.default", "aten.unique.default",
    "aten._unique.default", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten._local_scalar_dense.default", "aten.item.default",
    "aten.tolist.default", "aten.bincount.default", "aten.histc.default",
    "aten.sym_constrain_range.default", "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg", "aten.equal.default", "aten.is_nonzero.default",
    "aten.nonzero_numpy.default",
}


@pytest.fixture(scope="module")
def model():
    # Sparse regime with W = 4 and a small window, so a few dozen steps cross blocks and wrap.
    cfg = random_config(21, num_mosrah_heads=8, num_selected_heads=2, window_size=3,
                        num_decoder_layers=2, training_sequence_length=64)
    return randomize_(ShramForCausalLM(cfg), 21)


def inputs(cfg, n, seed, start=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, n), generator=gen)
    live = torch.rand(B, n, generator=gen) > 0.2
    return ids, torch.full((B,), start, dtype=torch.long), live


@pytest.mark.parametrize("batch", [B, 1])  # batch > 1 compiles with ROW_INPUTS_STORED
def test_decode_step_has_no_graph_breaks(model, batch):
    dec = StaticDecoder(model, batch_size=batch, prefill_chunk=C, compile=True)
    with torch.no_grad():
        ex = torch._dynamo.explain(dec.module)(*(t[:batch] for t in inputs(model.config, 1, 0)))
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1


def test_prefill_step_has_no_graph_breaks(model):
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=C)
    with torch.no_grad():
        ex = torch._dynamo.explain(dec.module)(*inputs(model.config, C, 0))
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1


@pytest.mark.parametrize("B", [B, 1])  # batch > 1 compiles with ROW_INPUTS_STORED
def test_compiled_steps_never_recompile_and_match_eager(model, B):
    """Three prefill chunks and more than 2*window_size decode steps, all with fresh inputs of
    the same shapes, under fail_on_recompile; outputs equal eager at every step."""
    torch._dynamo.reset()
    cfg = model.config
    eager = StaticDecoder(model, batch_size=B, prefill_chunk=C)
    # Dynamo checks the guards on every call, so a recompile fails here.
    # Batch 1 differs from batch 2 in the decode step only (its Inductor options), so its
    # prefill step runs eager: one cold Inductor compile fewer in CI.
    comp = StaticDecoder(model, batch_size=B, prefill_chunk=C, compile=True if B > 1 else ("decode",))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, 3 * C), generator=gen)
    mask = torch.rand(B, 3 * C, generator=gen) > 0.25
    mask[:, 0] = True
    # Warm-up compiles each step once (one graph per step), and Inductor's generated Python
    # wrapper checks no sizes or strides per call (decoder.NO_SIZE_ASSERTS: ~35 calls per layer).
    codes = []
    traces = torch._dynamo.utils.compilation_time_metrics  # Dynamo's timed phases, per call
    for k in ("invoke_subgraph_trace", "invoke_subgraph_reuse_stamp_out"):
        traces.pop(k, None)
    # The layer region's calls take flat arguments, which Dynamo fingerprints for reuse without
    # tracing pytree's flatten (step.py; seconds of a cold compile).
    fingerprint = torch._dynamo.variables.invoke_subgraph
    # Each step's C++ kernels are built a few files at a time (accelerators/kernel_builds.py).
    contraction = []  # Inductor's C++ contraction setting while it wrote each step's code

    def save(code):
        codes.append(code)
        contraction.append(torch._inductor.config.cpp.enable_floating_point_contract_flag)
    with unittest.mock.patch.object(GraphLowering, "save_output_code", save), \
            unittest.mock.patch.object(fingerprint, "build_fingerprint_with_pytree",
                                       wraps=fingerprint.build_fingerprint_with_pytree) as flattened, \
            recorded_builds() as batches:
        torch.testing.assert_close(comp.prefill(ids[:, :C], mask[:, :C]), eager.prefill(ids[:, :C], mask[:, :C]),
                                   atol=1e-4, rtol=1e-4)
        tok = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
        torch.testing.assert_close(comp.decode(tok), eager.decode(tok), atol=1e-4, rtol=1e-4)
    assert len(codes) == (2 if B > 1 else 1) and not [c for c in codes if "assert_size_stride(" in c]
    # ... and its C++ contracts multiply-adds into FMAs (decoder.FMA_CONTRACTION)
    assert contraction == ["fast"] * len(codes)
    # The decode step is fused C++ kernels only: its projections are row reductions (RowLinear),
    # its router's logits and top-k fused (FusedRouter), no cumsum at one token. An extern call
    # or an aten fallback here is a call out of the layer's kernel per layer and step.
    for call in ("extern_kernels.", "aten.topk", "aten.cumsum", "aten.mm", "aten.bmm"):
        assert call not in codes[-1], f"the compiled decode step calls {call}"
    assert flattened.call_count == 0
    # one file per compile thread at most, none built twice
    if get_compile_threads() > 1 and enabled("batched_kernel_builds"):
        assert len(batches) == len(codes)
        for kernels in batches:
            assert len({id(k.__self__) for k in kernels}) <= get_compile_threads() < len(kernels)
    # Dynamo traced the nested layer region once per step and reused it for the other layers
    # (step.py: the region returns a flat tuple of tensors, or Dynamo re-traces every layer).
    n_layers = cfg.num_decoder_layers
    assert len(traces.get("invoke_subgraph_trace", [])) == len(codes)
    assert len(traces.get("invoke_subgraph_reuse_stamp_out", [])) == len(codes) * (n_layers - 1)
    n_decode = 2 * cfg.window_size + 5
    with torch.compiler.set_stance("fail_on_recompile"):
        torch.testing.assert_close(comp.prefill(ids[:, C:], mask[:, C:]), eager.prefill(ids[:, C:], mask[:, C:]),
                                   atol=1e-4, rtol=1e-4)  # two more chunks
        for t in range(n_decode):
            tok = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
            active = torch.tensor([True, t % 3 != 1])[:B]
            torch.testing.assert_close(comp.decode(tok, active), eager.decode(tok, active),
                                       atol=1e-4, rtol=1e-4)
        comp.reset(); eager.reset()  # position 0 again: same graph, no recompile
        torch.testing.assert_close(comp.prefill(ids, mask), eager.prefill(ids, mask), atol=1e-4, rtol=1e-4)
        if B == 1:
            check_replaced_weight(comp, tok)
    if B == 1:  # Dynamo's caches cleared under a warmed-up decoder: it compiles again
        torch._dynamo.reset()
        torch.testing.assert_close(comp.decode(tok), eager.decode(tok), atol=1e-4, rtol=1e-4)
    # The routing history is integer state: exactly equal outside its write-sink rows.
    st = comp.state
    for name, a, b in zip(st.names(), st.tensors(), eager.state.tensors()):
        if name.endswith("routes"):
            a, b = (t.view(B, st.history + 1, -1)[:, :st.history] for t in (a, b))
            assert torch.equal(a, b), name


def check_replaced_weight(comp, tok):
    """Under fail_on_recompile, for a warmed-up decoder: a weight whose storage was replaced
    (here by a float64 copy, which the compiled kernels would read as float32) fails Dynamo's
    guards instead of being misread, and the failed call changes nothing."""
    w = comp.module.model.embed_tokens.weight
    count, orig = comp.live_counts, w.data
    w.data = orig.double()
    try:
        with pytest.raises(RuntimeError, match="recompil"):
            comp.decode(tok)
    finally:
        w.data = orig
    assert torch.equal(comp.live_counts, count)  # the failed call changed nothing


def export_step(model, n):
    """(decoder, its step exported with strict=True, a function that gives that program
    decomposed to core ATen: decomposed on first use, once for the two tests that read it, so a
    failing decomposition fails those tests, not the export's)."""
    dec = StaticDecoder(model, batch_size=B, prefill_chunk=C)
    with torch.no_grad():
        ep = torch.export.export(dec.module, inputs(model.config, n, 0, start=5), strict=True)
    return dec, ep, functools.cache(lambda: ep.run_decompositions({}))


@pytest.fixture(scope="module", params=[1, C], ids=["decode", "prefill"])
def exported(request, model):
    return export_step(model, request.param)


def test_step_exports_with_strict_true(exported):
    _, ep, _ = exported
    assert any(n.target == torch.ops.aten.topk.default for n in ep.graph.nodes)


def test_exported_step_has_no_data_dependent_ops(exported):
    graph = exported[2]().graph
    found = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name in DENYLIST:
            found.add(name)
        if name == "aten.repeat_interleave.Tensor" and "output_size" not in node.kwargs:
            found.add(name + " without output_size")
        if name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
            for ix in node.args[1]:  # boolean-mask indexing has a data-dependent shape
                if ix is not None and ix.meta["val"].dtype == torch.bool:
                    found.add(name + " with a boolean mask")
    assert not found, f"data-dependent ops in the exported step: {sorted(found)}"


def test_exported_step_updates_every_state_buffer_in_place(exported):
    dec, _, decomposed = exported
    mutated = set(decomposed().graph_signature.buffers_to_mutate.values())
    state = {"state." + n for n in dec.state.names()}
    assert state <= mutated, f"state buffers not updated in place: {sorted(state - mutated)}"
    # And nothing but state is written (weights and rope tables are read-only).
    assert mutated <= state


def test_exported_step_matches_eager(exported, model):
    dec, ep, _ = exported
    args = inputs(model.config, ep.example_inputs[0][0].shape[1], 7)
    eager = StaticDecoder(model, batch_size=B, prefill_chunk=C)
    with torch.no_grad():
        want = eager.module(*args)
        got = ep.module()(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
