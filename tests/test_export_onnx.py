"""ONNX export (`export_onnx` / `load_onnx`): golden logits and tokens, the graph contract
(names, checker, metadata, weights stored once), in-place state binding against two alternating
state sets, bad artifacts and host validation."""

import collections
import json
import os
import warnings

import numpy as np
import onnx
import pytest
import torch

from helpers import (GOLDEN_CASES, check_last_token_prefill, check_prefix_steps, check_verify_step, counting_traces,
                     golden_case, golden_run, load_benchmark, tiny_model)

from shram_static import StaticDecoder
from shram_static.export import ExportFormatError, export_onnx, load_onnx
from shram_static.export.onnx import graph_paths
from shram_static.console import LEAFSPEC_NOTICE

# The golden case (batch 2) whose export, with an EOS, is shared by its golden check and by
# every test of the graph contract below: one export fewer.
SHARED_CASE = "main_basic"


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """(paths, model) of the SHARED_CASE golden model exported for batch 2, chunk 8; torch's
    LeafSpec notice, which the export drops, is an error here."""
    model, _ = golden_case(SHARED_CASE)
    with warnings.catch_warnings(), counting_traces() as traces:
        warnings.filterwarnings("error", message=LEAFSPEC_NOTICE, category=FutureWarning)
        paths = export_onnx(model, tmp_path_factory.mktemp("onnx") / "m.onnx", batch_size=2, prefill_chunk=8,
                            eos_token_id=257, full_logits=True)  # the golden check reads every token's
    # The graph exported in this process (prefill; decode goes to a forked one): the exporter's
    # own trace and decomposition.
    assert traces == ["export", "decompose"], traces
    return paths, model


def test_golden_on_the_shared_export(builtin):
    _, g = golden_case(SHARED_CASE)
    err, tokens = golden_run(load_onnx(builtin[0]["decode"]), g)
    assert err <= 1e-3, f"{SHARED_CASE}: max abs logit error {err}"
    assert torch.equal(tokens, g["greedy_tokens"]), f"{tokens} != {g['greedy_tokens']}"


@pytest.mark.heavy
@pytest.mark.parametrize("name", [c for c in GOLDEN_CASES if c != SHARED_CASE])
def test_golden_logits_and_greedy(name, tmp_path):
    """Decode-only exports (the prompts go token by token through the decode graph; the prefill
    graph is checked on the shared export): golden logits and tokens. A prefill graph an
    earlier export left at the same path is removed; without its data file nothing loads."""
    model, g = golden_case(name)
    B = g["input_ids"].shape[0]
    stale = graph_paths(tmp_path / "m.onnx")["prefill"]
    with open(stale, "wb") as f:
        f.write(b"an earlier export's prefill graph")
    model.config.eos_token_id = 7  # no eos_token_id given: the config's, as export_pte
    paths = export_onnx(model, tmp_path / "m.onnx", batch_size=B, prefill_chunk=None)
    assert sorted(paths) == ["data", "decode"] and not os.path.exists(stale)
    dec = load_onnx(paths["decode"])
    assert dec.eos_token_id == 7
    assert dec.prefill_chunk == 1 and list(dec._graphs) == ["decode"]
    err, tokens = golden_run(dec, g)
    assert err <= 1e-3, f"{name}: max abs logit error {err}"
    assert torch.equal(tokens, g["greedy_tokens"]), f"{name}: {tokens} != {g['greedy_tokens']}"
    os.remove(paths["data"])
    with pytest.raises(FileNotFoundError, match="data"):
        load_onnx(paths["decode"])


def cache_copies(path, op: str = "Gather") -> list[str]:
    """`op` nodes of a graph whose data is a whole sparse cache, (experts, slots, u) (a view of a
    `past.*sparse_*` input, as many elements): each copies its caches on every call."""
    m = onnx.shape_inference.infer_shapes(onnx.load(path, load_external_data=False))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(m.graph.value_info) + list(m.graph.input)}
    sizes = {int(np.prod(shapes[i.name])) for i in m.graph.input if ".sparse_" in i.name}
    return [n.name for n in m.graph.node if n.op_type == op and len(shapes.get(n.input[0], [])) > 2
            and int(np.prod(shapes[n.input[0]])) in sizes]


def set_export_meta(path, **changes) -> str:
    """Rewrites the graph at `path` with each key of `changes` set in its `shram_export`
    metadata (dropped where the value is None); returns `path`."""
    m = onnx.load(path, load_external_data=False)
    props = {q.key: q.value for q in m.metadata_props}
    meta = {k: v for k, v in json.loads(props["shram_export"]).items() if k not in changes}
    meta.update({k: v for k, v in changes.items() if v is not None})
    onnx.helper.set_model_props(m, dict(props, shram_export=json.dumps(meta)))
    onnx.save(m, path)
    return path


@pytest.mark.heavy
def test_last_token_prefill_and_verify_graphs(tmp_path, monkeypatch):
    """The default export (`full_logits=False`) with a verify graph as wide as its prefill
    chunk: the prefill graph returns each row's last live token's logits, [B, 1, V], and
    verification runs the verify graph, not prefill (`check_last_token_prefill`); verify,
    per-row rollback and speculative generation against the eager decoder (`check_verify_step`).
    Both attend every expert's cache where it lies: no Gather copies a whole expert cache per
    query. Every graph attends a prefix of the sparse caches, its length an input of dynamic
    size that the runner picks per step (`check_prefix_steps`)."""
    model = tiny_model(num_decoder_layers=1, training_sequence_length=64)  # one layer: half the export
    paths = export_onnx(model, tmp_path / "m.onnx", batch_size=3, prefill_chunk=4, verify_len=4,
                        prefix_lengths=(4, 8))
    assert sorted(paths) == ["data", "decode", "prefill", "verify"]
    for role in ("prefill", "verify"):
        assert not cache_copies(paths[role]), role
    # decode gathers the rows it reads: no slice copies every expert's cache prefix
    assert not cache_copies(paths["decode"], "Slice")
    for role in ("decode", "prefill", "verify"):
        m = onnx.load(paths[role], load_external_data=False)
        slots = [i for i in m.graph.input if i.name == "slots"]
        assert len(slots) == 1 and [d.dim_param for d in slots[0].type.tensor_type.shape.dim] == ["P"], role
        assert json.loads({p.key: p.value for p in m.metadata_props}["shram_export"])["prefix_lengths"] == [4, 8, 20]
    dec = load_onnx(paths["decode"])
    assert dec.meta["full_logits"] is False and list(dec._graphs["prefill"].logits.shape) == [3, 1, 259]
    check_last_token_prefill(dec, model)
    check_verify_step(dec, model)
    check_prefix_steps(dec, model, monkeypatch)
    # the same graphs with metadata that lists no lengths (an older export's): refused, not run
    set_export_meta(paths["decode"], prefix_lengths=None)
    with pytest.raises(ExportFormatError, match="slots"):
        load_onnx(paths["decode"])


def test_graph_contract(builtin):
    paths, model = builtin
    assert paths == graph_paths(paths["decode"])
    names = load_onnx(paths["decode"]).names
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for role, C in (("decode", 1), ("prefill", 8)):
        onnx.checker.check_model(paths[role], full_check=True)
        m = onnx.load(paths[role], load_external_data=False)
        assert [i.name for i in m.graph.input] == ["input_ids", "position_ids", "live"] + [f"past.{n}" for n in names]
        assert [o.name for o in m.graph.output] == ["logits"] + [f"present.{n}" for n in names]
        dims = [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim]
        assert dims == [2, C, model.config.vocab_size]
        props = {p.key: p.value for p in m.metadata_props}
        assert json.loads(props["shram_config"]) == json.loads(model.config.to_json_string(use_diff=False))
        meta = json.loads(props["shram_export"])
        assert meta["role"] == role and meta["batch_size"] == 2 and meta["prefill_chunk"] == 8
        # weights live in the shared data file, not in the graph: only small tensors (norm
        # scales, index tables) stay inline. (File size is no proxy: on a model this small the
        # graph structure alone is about as large as the weights.)
        inline = [t for t in m.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        assert all(len(t.raw_data) < 1024 for t in inline), [t.name for t in inline if len(t.raw_data) >= 1024]
        assert sum(len(t.raw_data) for t in inline) < 0.01 * param_bytes
        # export.onnx_fusions: each RMSNorm (2 per layer and the final one) and each RoPE (q and
        # k of both paths: main-sequence rows) is one opset-23 node; no max tree is left (L = 8)
        ops = collections.Counter(n.op_type for n in m.graph.node)
        n_layers = model.config.num_decoder_layers
        assert [(o.domain, o.version) for o in m.opset_import] == [("", 23)]
        assert ops["RMSNormalization"] == 2 * n_layers + 1 and ops["RotaryEmbedding"] == 4 * n_layers, ops
        assert not {"Neg", "Reciprocal", "Max"} & set(ops), ops
        consts = [a.t for n in m.graph.node if n.op_type == "Constant" for a in n.attribute if a.type == a.TENSOR]
        assert all(len(t.raw_data) < 1024 for t in consts)
        external = {t.name for t in m.graph.initializer} - {t.name for t in inline}
        assert "model.lm_head.weight" in external or any("embed" in n for n in external)
    # both graphs' weights are stored once (the exporter folds some weights into differently
    # named constants per graph; the data file is deduplicated by content)
    assert os.path.getsize(paths["data"]) < 1.25 * param_bytes


def test_inplace_binding_matches_alternating_states(builtin):
    """IOBinding with present.X bound to past.X's OrtValue is only correct when no node reads an
    old state tensor after writing it: compare against two alternating state sets."""
    paths, _ = builtin
    fast, ref = load_onnx(paths["decode"], inplace=True), load_onnx(paths["decode"], inplace=False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 21), generator=gen)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row
    outs = {}
    for name, d in (("fast", fast), ("ref", ref)):
        seq = [d.prefill(ids[:, :13], mask[:, :13]), d.prefill(ids[:, 13:], mask[:, 13:])]
        for t in range(12):
            seq.append(d.decode(ids[:, t], torch.tensor([True, t % 3 != 0]))[:, None])
        outs[name] = torch.cat(seq, dim=1)
    assert torch.equal(outs["fast"], outs["ref"])
    for n, a in fast.state_arrays().items():
        assert np.array_equal(a, ref.state_arrays()[n]), n


def test_matches_static_decoder_and_reset(builtin):
    paths, model = builtin
    dec, ref = load_onnx(paths["decode"]), StaticDecoder(model, batch_size=2, prefill_chunk=8, eos_token_id=257)
    prompt = torch.tensor([[256, 72, 101, 108, 108, 111], [256, 87, 111, 114, 108, 100]])
    a = dec.generate(prompt, max_new_tokens=16)
    b = ref.generate(prompt, max_new_tokens=16)
    assert torch.equal(a, b)
    dec.reset()
    assert torch.equal(dec.generate(prompt, max_new_tokens=16), a)
    # warm-up (`HostDecoder.warm_up`, what `serve` and `bench` run first): dead tokens only
    dec.reset()
    dec.warm_up()
    assert dec.live_counts.tolist() == [0, 0]
    assert torch.equal(dec.generate(prompt, max_new_tokens=16), a)
    with pytest.raises(ValueError, match="no 'verify' step to warm up"):
        dec.warm_up(("decode", "verify"))


def test_bad_artifacts(builtin, tmp_path):
    import shutil

    paths, model = builtin
    with pytest.raises(FileNotFoundError):
        load_onnx(tmp_path / "missing.onnx")

    def copy_export(dst):
        out = graph_paths(dst)
        for role in ("decode", "prefill", "data"):
            shutil.copy(paths[role], out[role])
        return out

    p = copy_export(tmp_path / "a.onnx")
    os.remove(p["prefill"])
    with pytest.raises(FileNotFoundError, match="prefill"):
        load_onnx(p["decode"])

    p = copy_export(tmp_path / "b.onnx")
    data = open(p["decode"], "rb").read()
    open(p["decode"], "wb").write(data[:len(data) // 2])
    with pytest.raises(ExportFormatError, match="truncated"):
        load_onnx(p["decode"])

    p = copy_export(tmp_path / "c.onnx")
    data = open(p["data"], "rb").read()
    open(p["data"], "wb").write(data[:len(data) // 2])
    with pytest.raises(ExportFormatError):
        load_onnx(p["decode"])

    # a prefill graph from another export beside this decode graph: the same graph with the
    # export id another export would have written (exporting again would take a minute)
    p = copy_export(tmp_path / "d.onnx")
    m = onnx.load(p["prefill"], load_external_data=False)
    props = {q.key: q.value for q in m.metadata_props}
    meta = json.loads(props["shram_export"])
    meta["export_id"] = "0" * 32
    onnx.helper.set_model_props(m, dict(props, shram_export=json.dumps(meta)))
    onnx.save(m, p["prefill"])
    with pytest.raises(ExportFormatError, match="another export"):
        load_onnx(p["decode"])

    # an ONNX model that export_onnx did not write
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    foreign = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])],
                                                            "g", [x], [y]))
    p = copy_export(tmp_path / "e.onnx")
    onnx.save(foreign, p["decode"])
    with pytest.raises(ExportFormatError, match="not written by"):
        load_onnx(p["decode"])

    def with_meta(folder, **changes):  # a copy named as the original: its graphs name m.onnx.data
        (tmp_path / folder).mkdir()
        out = copy_export(tmp_path / folder / os.path.basename(paths["decode"]))
        return set_export_meta(out["decode"], **changes)

    # prefix lengths in the metadata of graphs that take no slots: a file from another export
    with pytest.raises(ExportFormatError, match="slots"):
        load_onnx(with_meta("f", prefix_lengths=[4, 8, 20]))
    # an export written before prefix lengths (no such key) runs its whole-cache graphs
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    assert torch.equal(load_onnx(with_meta("g", prefix_lengths=None)).prefill(ids),
                       load_onnx(paths["decode"]).prefill(ids))


def test_host_validation_keeps_state(builtin):
    paths, model = builtin
    dec, ref = load_onnx(paths["decode"]), StaticDecoder(model, batch_size=2, prefill_chunk=8)
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    for d in (dec, ref):
        d.prefill(ids)
        with pytest.raises(ValueError):
            d.decode(torch.tensor([1, model.config.vocab_size]))
        with pytest.raises(ValueError):
            d.decode(torch.tensor([1]))
        with pytest.raises(TypeError):
            d.prefill(ids.float())
        with pytest.raises(ValueError):
            d.prefill(torch.zeros(2, model.config.inference_sequence_length, dtype=torch.long))
    a, b = dec.decode(torch.tensor([42, 43])), ref.decode(torch.tensor([42, 43]))
    assert (a - b).abs().max() < 1e-4


def test_rollback_and_speculation_without_a_verify_graph(builtin):
    """An export without a verify graph rolls back per row up to its prefill chunk, exactly as
    eager does; speculation verifies through the prefill graph and gives greedy's tokens."""
    paths, model = builtin
    dec, ref = load_onnx(paths["decode"]), StaticDecoder(model, 2, 8, verify_len=None)
    assert dec.rollback_limit == 8 and dec.verify_len is None
    ids = torch.tensor([[72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32, 72]] * 2)
    for d in (dec, ref):
        d.prefill(ids)
        d.rollback(torch.tensor([6, 1]))
    tok = torch.tensor([33, 34])
    assert (dec.decode(tok) - ref.decode(tok)).abs().max() < 1e-4
    assert torch.equal(dec.generate(ids, max_new_tokens=24, speculate=3), ref.generate(ids, max_new_tokens=24))


def test_rows_join_and_restart_while_others_decode(builtin):
    """Continuous batching on the exported graphs: row 1 restarts at position 0 and prefills a
    chunk in the same prefill-shape step that carries row 0's next decode token; each row's
    logits are those of its own sequence alone (the uncached forward)."""
    paths, model = builtin
    dec = load_onnx(paths["decode"])
    V, C = model.config.vocab_size, dec.prefill_chunk
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, V, (12,), generator=gen)  # row 0's sequence
    b_old = torch.randint(0, V, (9,), generator=gen)  # row 1's first sequence, then abandoned
    b = torch.randint(0, V, (C,), generator=gen)  # row 1's new prompt: one whole chunk
    dec.prefill(torch.stack([a[:10], torch.cat([b_old, b_old[:1]])]), torch.tensor([[1] * 10, [1] * 9 + [0]]))
    dec.reset_rows([1])
    assert dec.live_counts.tolist() == [10, 0]
    ids = torch.zeros(2, C, dtype=torch.long)
    ids[0, 0], ids[1] = a[10], b
    live = torch.zeros(2, C, dtype=torch.bool)
    live[0, 0], live[1] = True, True
    got = dec.step(ids, live)  # (2, C, V)
    assert dec.live_counts.tolist() == [11, C]
    nxt = dec.step(torch.stack([a[11:12], b[:1]]), torch.tensor([[True], [False]]))  # row 1 idle
    with torch.no_grad():
        ref_a = model(a[None]).logits[0]  # (12, V)
        ref_b = model(b[None]).logits[0]  # (C, V)
    assert (got[0, 0] - ref_a[10]).abs().max() < 1e-3
    assert (got[1] - ref_b).abs().max() < 1e-3
    assert (nxt[0, 0] - ref_a[11]).abs().max() < 1e-3
    with pytest.raises(ValueError):  # a bad row leaves every count as it was
        dec.reset_rows([2])
    assert dec.live_counts.tolist() == [12, C]


def test_matmul_only_graph_of_the_benchmark(builtin, tmp_path):
    """`benchmarks/onnx_matmuls.py` builds a graph of the decode graph's weight matmuls alone:
    every MatMul/Gemm over an initializer, once each, over the same weights, and onnxruntime
    runs it (each output the sum of the row of ones it is fed times its weight)."""
    import onnxruntime as ort

    mod = load_benchmark("onnx_matmuls")
    decode = onnx.load(builtin[0]["decode"])
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in decode.graph.initializer}
    want = [n for n in decode.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits]
    out = str(tmp_path / "mm.onnx")
    count, nbytes = mod.matmul_graph(builtin[0]["decode"], out)
    assert count == len(want) > 0
    assert nbytes == sum(inits[w].nbytes for w in {n.input[1] for n in want})
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: np.ones(i.shape, np.float32) for i in sess.get_inputs()})[0]
    # each node's output summed: ones @ W sums to W's sum (transposed or not)
    want_sums = np.array([inits[n.input[1]].sum(dtype=np.float64) for n in want])
    np.testing.assert_allclose(got.reshape(-1), want_sums, rtol=1e-4, atol=1e-3)


def test_benchmarks_time_each_run_in_alternating_rounds(monkeypatch):
    """`onnx_matmuls.interleaved` (which `pte_linears.py` shares) calls every run `steps` + 3
    times per round, reverses the order every other round and reads the bandwidth after each
    round."""
    from shram_static.bench import readings

    mod = load_benchmark("onnx_matmuls")
    calls, readings_taken = [], []
    monkeypatch.setattr(readings, "measure_bandwidth", lambda: readings_taken.append(1) or 4e10)
    runs = [(name, lambda name=name: calls.append(name)) for name in ("a", "b")]
    times, bw, all_bw = mod.interleaved(runs, rounds=3, steps=2)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert bw == 4e10 and all_bw == [4e10] * 3 and len(readings_taken) == 3
    assert calls == ["a"] * 5 + ["b"] * 5 + ["b"] * 5 + ["a"] * 5 + ["a"] * 5 + ["b"] * 5
