"""ExecuTorch export (`export_pte` / `load_pte`): golden logits and tokens, the stock
`TextLLMRunner`, graph contents, initial state, bad artifacts, host validation and int8.

Slow: every program is lowered through XNNPACK (tens of seconds per method of a 2-layer model
on two cores), so each artifact is built once per module and shared by the tests that
read it, and a test that needs no prefill method lowers a decode-only program
(`prefill_chunk=None`, the artifact ExecuTorch's stock runner uses). The prefill method is
checked on the shared program of one golden case (golden logits, and chunks with dead tokens
against StaticDecoder); batched prefill with left padding on every other backend, ONNX included.
"""

import collections
import contextlib
import json
import os
import warnings

import pytest
import torch

from helpers import (GOLDEN_CASES, LOWERING_ACCELERATORS, STOCK_LOWERING_CASE, check_last_token_prefill,
                     check_verify_step, golden_case, golden_run, tiny_model)

from shram_static import StaticDecoder
from shram_static.accelerators import enabled
from shram_static.console import LEAFSPEC_NOTICE
from shram_static.export import ExportFormatError, export_onnx, export_pte, load_pte
from shram_static.export import pte
from shram_static.export.forked import can_fork
from shram_static.export.pte import lower_program, program_ops
from shram_static.export.quantize import quantize_weights
from shram_static.tokenizer import ByteTokenizer, bytes_to_unicode


EOS, BOS = ByteTokenizer.eos_token_id, ByteTokenizer.bos_token_id

# Portable kernels the shared program (SHARED_CASE) may call (everything else is inside the
# XNNPACK delegate). A new kernel here must be deliberate: check it exists in the runtime
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
}
# Recorded on the shared program (2 layers, L = 8, K = 2, batch 1, chunk 8; the tiny test model,
# which has the same layer structure, gives the same counts): portable-kernel calls, XNNPACK
# delegate calls and the share of ops left to portable kernels, portable / (portable +
# delegated). What is left outside the delegates is routing (topk, the block solver's
# comparisons), the index bookkeeping of the cache writes and dtype casts, none of which XNNPACK
# takes (docs/design.md, "How each backend runs the step").
# Lower them when the graph improves; a rise (a new portable op splitting a delegate) fails.
RECORDED = {"forward": {"portable": 171, "delegate_calls": 9, "share": 0.308},
            "prefill": {"portable": 305, "delegate_calls": 13, "share": 0.409}}
# XNNPACK delegate calls of the one-layer tiny model's decode-only quantized program (int8 or
# 8da4w), as of its fp32 program: a rise means an op left the delegate and split it.
QUANTIZED_DELEGATE_CALLS = 5
# Kernels the decode step must never run: expand_copy is what a >2-D matmul left to portable
# kernels becomes, a copy of a whole gathered cache or expert block per layer and token.
FORBIDDEN_IN_DECODE = {"aten::expand_copy.out"}


# The golden case (batch 1) whose program, with a prefill method and BOS/EOS, is shared by its
# golden check and by every test of the program's contract below: one lowering fewer.
SHARED_CASE = "yarn_extended"


# Methods of the shared program that came back from a forked lowering (`run_jobs`).
TRANSFERRED = []


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """(path, ExecutorchProgramManager, model) of the SHARED_CASE golden model, batch 1, chunk 8.

    Lowered as `export_pte` does by default: the decode method in a forked process where the
    machine allows; a failed child (whose method would be lowered again here) is an error, and so
    is torch's LeafSpec notice, which lowering drops (in either process)."""
    model, _ = golden_case(SHARED_CASE)
    received = pte.edge_program_from_value
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.filterwarnings("error", message="the parallel process", category=RuntimeWarning)
        warnings.filterwarnings("error", message=LEAFSPEC_NOTICE, category=FutureWarning)
        mp.setattr(pte, "edge_program_from_value", lambda v: TRANSFERRED.append(1) or received(v))
        et = lower_program(model, batch_size=1, prefill_chunk=8, eos_token_id=EOS, bos_token_id=BOS,
                           full_logits=True)  # the golden check reads every token's logits
    path = tmp_path_factory.mktemp("pte") / "builtin.pte"
    path.write_bytes(et.buffer)
    return str(path), et, model


def test_golden_with_prefill_method(builtin):
    """The shared program (prefill in chunks of 8, the second prompt part starting mid routing
    block) against the golden logits and greedy tokens."""
    model, g = golden_case(SHARED_CASE)
    dec = load_pte(builtin[0])
    assert dec.prefill_chunk == 8 and "prefill" in dec.method_names
    err, tokens = golden_run(dec, g)
    assert err <= 1e-3, f"{SHARED_CASE}: max abs logit error {err}"
    assert torch.equal(tokens, g["greedy_tokens"]), f"{tokens} != {g['greedy_tokens']}"


@pytest.mark.skipif(not can_fork() or not enabled("parallel_lowering"),
                    reason="one process: Linux with two usable CPUs and the accelerator parallel_lowering")
def test_shared_program_lowered_in_two_processes(builtin):
    """The golden test above ran on a program whose decode method was lowered in a forked
    process and sent back (tests/test_lowering.py: such a method emits the same program)."""
    assert len(TRANSFERRED) == 1


@pytest.mark.heavy
def test_last_token_prefill_and_verify_methods(tmp_path):
    """The default export (`full_logits=False`) with a verify method as wide as its prefill
    chunk: `prefill` returns each row's last live token's logits, [B, 1, V], and verification
    runs `verify`, not `prefill` (`check_last_token_prefill`); verify, per-row rollback and
    speculative generation against the eager decoder (`check_verify_step`). `verify` attends
    every expert's cache where it lies, as `prefill` does: no cache gathered per query (a
    portable copy of C*K caches per layer)."""
    model = tiny_model(num_decoder_layers=1, training_sequence_length=64)  # one layer: half the export
    et = lower_program(model, batch_size=3, prefill_chunk=4, verify_len=4)
    (tmp_path / "m.pte").write_bytes(et.buffer)
    dec = load_pte(str(tmp_path / "m.pte"))
    assert dec.meta["full_logits"] is False and dec.meta["verify_method"] == "verify"
    for method in ("prefill", "verify"):
        assert "aten::index_select.out" not in program_ops(et, method)["kernels"], method
    check_last_token_prefill(dec, model)
    check_verify_step(dec, model)


# Decode-only programs of the golden cases but the shared one; STOCK_LOWERING_CASE's is checked in
# tests/test_accelerators.py (golden logits, and the same bytes as the stock lowering) wherever
# the lowering accelerators run, so here only where they do not.
DECODE_ONLY_CASES = [c for c in GOLDEN_CASES if c != SHARED_CASE and not (
    c == STOCK_LOWERING_CASE and all(enabled(n) for n in LOWERING_ACCELERATORS))]


@pytest.mark.heavy
@pytest.mark.parametrize("name", DECODE_ONLY_CASES)
def test_golden_logits_and_greedy(name, tmp_path):
    model, g = golden_case(name)
    B = g["input_ids"].shape[0]
    # decode only: the prompts go token by token, as the stock runner feeds them
    path = export_pte(model, tmp_path / f"{name}.pte", batch_size=B, prefill_chunk=None)
    dec = load_pte(path)
    assert dec.batch_size == B and dec.prefill_chunk == 1 and "prefill" not in dec.method_names
    assert "verify" not in dec.method_names and dec.meta["verify_method"] is None
    assert dec.meta["decode_method"] == ("forward" if B == 1 else "decode")
    err, tokens = golden_run(dec, g)
    assert err <= 1e-3, f"{name}: max abs logit error {err}"
    assert torch.equal(tokens, g["greedy_tokens"]), f"{name}: {tokens} != {g['greedy_tokens']}"
    # no BOS/EOS given and none in the config: the LLM constant methods say so
    get = lambda m: dec._program.load_method(m).execute([])  # noqa: E731
    assert get("get_eos_ids") == [] and get("get_bos_id") == [-1] and get("get_max_batch_size") == [B]


def test_stock_runner_generates_like_static_decoder(builtin, tmp_path):
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    path, _, model = builtin
    tok = ByteTokenizer()
    tok.save(tmp_path)
    # The python binding hands each piece to the callback as `str` and raises
    # UnicodeDecodeError on a lone non-UTF-8 byte (ids 128-255 of a byte tokenizer). A copy of
    # tokenizer.json without its decoder emits each token's vocab string instead (one GPT-2
    # printable character), which maps back to the id exactly; encoding is unchanged.
    spec = tok.to_json()
    spec["decoder"] = None
    # The golden model's vocabulary has ids past the byte tokenizer's: name them, so the runner
    # can emit every id the model may pick.
    proto = spec["added_tokens"][-1]
    spec["added_tokens"] += [dict(proto, id=i, content=f"<extra_{i}>")
                             for i in range(tok.vocab_size, model.config.vocab_size)]
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    (ids_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    to_id = {ch: b for b, ch in bytes_to_unicode().items()}
    to_id.update({t["content"]: t["id"] for t in spec["added_tokens"]})

    runner = TextLLMRunner(path, str(ids_dir / "tokenizer.json"))
    ref = StaticDecoder(model, batch_size=1, prefill_chunk=8, eos_token_id=EOS)
    n = 24
    for prompt in ("Hello, SHRAM!", "A second prompt after reset()"):
        pieces = []
        cfg = GenerationConfig(echo=False, max_new_tokens=n, temperature=0.0, num_bos=1)
        runner.generate(prompt, cfg, token_callback=pieces.append)
        got = [to_id[p] for p in pieces]
        want = ref.generate(torch.tensor([tok.encode(prompt)]), max_new_tokens=n)[0].tolist()
        if EOS in want:  # the runner stops after emitting EOS; the decoder pads with it
            want = want[:want.index(EOS) + 1]
        assert got == want, f"prompt {prompt!r}: runner {got} != StaticDecoder {want}"
        runner.reset()  # restarts at position 0 without clearing buffers


def test_graph_ops(builtin):
    from executorch.runtime import Runtime

    _, et, model = builtin
    registered = Runtime.get().operator_registry.operator_names
    n_layers = model.config.num_decoder_layers
    for method, rec in RECORDED.items():
        ops = program_ops(et, method)
        kernels = ops["kernels"]
        assert ops["backends"] == ["XnnpackBackend"] and ops["delegate_calls"] > 0, ops
        assert set(kernels) <= ALLOWED_KERNELS, f"{method}: kernels outside the allowlist: " \
                                                f"{sorted(set(kernels) - ALLOWED_KERNELS)}"
        missing = {k.split(".")[0] for k in kernels} - {k.split(".")[0] for k in registered}
        assert not missing, f"{method}: kernels the runtime does not register: {missing}"
        # cache writes stay in place: no out-of-place index_put, and at most one copy_ per
        # layer (no whole-cache write-back)
        assert "aten::index_put.out" not in kernels
        if method == "forward":
            assert not set(kernels) & FORBIDDEN_IN_DECODE, kernels
        else:  # a chunk attends every expert's cache where it lies: no cache gathered per query
            assert "aten::index_select.out" not in kernels, kernels
        assert kernels.get("aten::copy_", 0) <= n_layers, kernels
        portable = sum(kernels.values())
        share = portable / (portable + ops["delegated_ops"])
        print(f"{method}: {portable} portable kernel calls, {ops['delegate_calls']} delegate calls, share {share:.3f}")
        assert portable <= rec["portable"], f"{method}: {portable} portable kernel calls (recorded {rec['portable']})"
        assert ops["delegate_calls"] <= rec["delegate_calls"], f"{method}: {ops['delegate_calls']} delegate calls"
        assert share <= rec["share"] + 0.005, f"{method}: portable share {share:.3f} (recorded {rec['share']})"


def delegated_ops(et, method: str):
    """(op name, node) of every op inside the method's XNNPACK delegates, e.g. ("bmm", node)."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    for _, mod in et.exported_program(method).graph_module.named_children():
        if isinstance(mod, LoweredBackendModule):
            for node in mod.original_module.graph.nodes:
                if node.op == "call_function":
                    # an edge op prints as "<EdgeOpOverload: aten.sqrt.default>: schema = ..."
                    yield str(node.target).split(">")[0].split(".")[1], node


def test_no_product_of_one_column(builtin):
    """No delegated bmm multiplies by a one-column matrix: XNNPACK ran the scores of a query
    against its keys as (k q^T)^T twice as slow as q k^T with the keys' transpose (the bench
    model's `.pte` decode step 0.96-0.98x; `masked_attention`)."""
    et = builtin[1]
    products = 0
    for method in RECORDED:
        for name, node in delegated_ops(et, method):
            if name == "bmm":
                products += 1
                a, b = (x.meta["val"].shape for x in node.args[:2])
                assert b[-1] > 1, f"{method}: bmm {tuple(a)} x {tuple(b)} of one column"
    assert products  # the attention's products are delegated


def test_no_delegate_copies_a_weight_or_cache(builtin):
    """No XNNPACK delegate reshapes, slices or transposes a weight, a state buffer or a cache
    write's output: inside a delegate each of those is a copy of the whole tensor per call (the
    fused expert weights would be without `shram_static.export.partition`, and the written caches
    without `written_cache_views_pass`);
    outside one, a reshape is a free view."""
    et = builtin[1]
    copies = ("view_copy", "slice_copy", "permute_copy", "expand_copy")
    checked = 0
    for method in RECORDED:
        top = et.exported_program(method)
        # weights by their placeholder names (a delegate's inputs keep the program's names)
        weights = set(top.graph_signature.inputs_to_parameters) | set(top.graph_signature.inputs_to_lifted_tensor_constants)
        buffers = set(top.graph_signature.inputs_to_buffers)
        # a cache write's output enters a delegate under the write's pre-reinplace node name
        written = lambda name: name in buffers or name.startswith("aten_index_put")  # noqa: E731
        for name, node in delegated_ops(et, method):
            src = node.args[0] if node.args else None
            if isinstance(src, torch.fx.Node) and src.op == "placeholder" and (src.name in weights or written(src.name)):
                checked += src.name in weights
                assert name not in copies, f"{method}: a delegate copies {src.name} {tuple(src.meta['val'].shape)}"
    assert checked  # delegates read weights


def test_loading_moves_the_packed_weights_onto_huge_pages(builtin, monkeypatch):
    """`load_pte` collapses the process's resident memory onto huge pages once, after loading
    the methods (XNNPACK packs the weights then; before it, they would stay on 4 KiB pages)."""
    from executorch.runtime import Program

    from shram_static import hugepages
    events, load = [], Program.load_method
    monkeypatch.setattr(Program, "load_method", lambda self, name: events.append(f"load {name}") or load(self, name))
    monkeypatch.setattr(hugepages, "collapse_resident", lambda regions=None: events.append(regions) or 0)
    load_pte(builtin[0])
    assert events[-1] is None and events.count(None) == 1 and len(events) > 1


def test_state_initialised_and_shared(builtin):
    """Every state buffer of the decode method carries its starting bytes, once (a view of a
    buffer is a plain tensor at the buffer's place, without its name or bytes:
    `shram_static.export.views.state_view_planning`); both methods place each buffer at the same
    planned location (one shared copy)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    path, _, model = builtin
    raw = deserialize_pte_binary(open(path, "rb").read())
    program = getattr(raw, "program", raw)
    found = {}
    for plan in program.execution_plan:
        for v in plan.values:
            t = v.val
            info = getattr(t, "extra_tensor_info", None)
            if info is not None and (info.fully_qualified_name or "").startswith("step.state."):
                a = t.allocation_info
                per = found.setdefault(info.fully_qualified_name, {})
                assert plan.name not in per, f"{info.fully_qualified_name} named twice in {plan.name}"
                per[plan.name] = (t.data_buffer_idx, a.memory_id, a.memory_offset_low, a.memory_offset_high)
    names = load_pte(path).meta["state_names"]
    assert sorted(found) == sorted(f"step.state.{n}" for n in names)
    for fqn, per in found.items():
        assert set(per) == {"forward", "prefill"}, fqn
        assert per["forward"][0] > 0, f"{fqn}: no initial data in the decode method"
        assert per["forward"][1:] == per["prefill"][1:], f"{fqn}: methods do not share the buffer"
    # behaviour: a freshly loaded program, decode from position 0, matches eager
    dec = load_pte(path)
    ref = StaticDecoder(model, 1, 8)
    ids = torch.tensor([[72, 105, 33, 0, 255]])
    a, b = dec.prefill(ids), ref.prefill(ids)
    assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-4


def test_shared_packed_weights_give_the_stock_logits(builtin, tmp_path):
    """Loading a .pte turns XNNPACK's weight cache on where the accelerator is verified
    (ExecuTorch 1.5.1; off elsewhere), and its steps give the stock path's logits: the same
    program run in a process with the accelerator off (the option is process-wide)."""
    import subprocess
    import sys

    from shram_static.accelerators import STOCK_ENV, unverified
    from shram_static.export.backend_options import weight_cache_enabled

    def steps(d):
        return [d.prefill(torch.arange(1, 12)[None]), d.decode(torch.tensor([5])), d.decode(torch.tensor([7]))]

    got = steps(load_pte(builtin[0]))  # this process: the accelerator as the environment says
    if unverified("xnnpack_weight_cache"):  # another ExecuTorch: stock, nothing to compare
        assert not weight_cache_enabled()
        return
    if os.environ.get(STOCK_ENV, "").strip() in ("", "0"):
        assert weight_cache_enabled()
    code = ("import sys, torch; from shram_static.export import load_pte; "
            "from shram_static.export.backend_options import weight_cache_enabled; "
            "d = load_pte(sys.argv[1]); ids = torch.arange(1, 12)[None]; "
            "lg = [d.prefill(ids), d.decode(torch.tensor([5])), d.decode(torch.tensor([7]))]; "
            "torch.save(lg, sys.argv[2]); print(weight_cache_enabled())")
    out = tmp_path / "stock.pt"
    r = subprocess.run([sys.executable, "-c", code, builtin[0], str(out)],
                       env={**os.environ, STOCK_ENV: "xnnpack_weight_cache"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "False"
    for a, b in zip(got, torch.load(out), strict=True):
        assert torch.equal(a, b)


def test_constant_methods(builtin):
    from executorch.runtime import Runtime

    path, _, model = builtin
    prog = Runtime.get().load_program(path)
    get = lambda name: prog.load_method(name).execute([])  # noqa: E731
    S = model.config.inference_sequence_length
    assert get("get_max_seq_len") == [S] and get("get_max_context_len") == [S]
    assert get("use_kv_cache") == [True] and get("enable_dynamic_shape") == [False]
    assert get("get_eos_ids") == [EOS] and get("get_bos_id") == [BOS]
    # what optimum-executorch's ExecuTorchModelForCausalLM reads (get_dtype: c10 ScalarType, 6 = float32)
    assert get("get_vocab_size") == [model.config.vocab_size] and get("get_max_batch_size") == [1]
    assert get("get_dtype") == [6]
    assert json.loads(get("get_shram_config")[0]) == json.loads(model.config.to_json_string(use_diff=False))
    dec = load_pte(path)
    assert dec.config.to_dict() == model.config.to_dict() and dec.eos_token_id == EOS


def test_bad_artifacts(builtin, tmp_path):
    path, _, _ = builtin
    with pytest.raises(FileNotFoundError):
        load_pte(tmp_path / "missing.pte")
    data = open(path, "rb").read()
    for frac in (0.5, 0.99):
        cut = tmp_path / f"cut{frac}.pte"
        cut.write_bytes(data[:int(len(data) * frac)])
        with pytest.raises(ExportFormatError, match="truncated"):
            load_pte(cut)
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"not a program at all" * 10)
    with pytest.raises(ExportFormatError, match="not an ExecuTorch program"):
        load_pte(junk)
    # a valid ExecuTorch program that export_pte did not write
    from executorch.exir import to_edge_transform_and_lower

    class Plus(torch.nn.Module):
        def forward(self, x):
            return x + 1

    foreign = tmp_path / "foreign.pte"
    ep = torch.export.export(Plus(), (torch.zeros(2),), strict=True)
    foreign.write_bytes(to_edge_transform_and_lower(ep).to_executorch().buffer)
    with pytest.raises(ExportFormatError, match="not written by"):
        load_pte(foreign)


def test_host_validation_keeps_state(builtin):
    path, _, model = builtin
    dec, ref = load_pte(path), StaticDecoder(model, 1, 8)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    for d in (dec, ref):
        d.prefill(ids)
        with pytest.raises(ValueError):
            d.decode(torch.tensor([model.config.vocab_size]))  # id out of range
        with pytest.raises(ValueError):
            d.decode(torch.tensor([1, 2]))  # wrong batch
        with pytest.raises(TypeError):
            d.prefill(ids.float())
        with pytest.raises(ValueError):
            d.prefill(torch.zeros(1, model.config.inference_sequence_length, dtype=torch.long))  # capacity
        d.decode(torch.tensor([7]), active=torch.tensor([False]))  # a dead token is a no-op
    assert torch.equal(dec.live_counts, ref.live_counts)
    a, b = dec.decode(torch.tensor([42])), ref.decode(torch.tensor([42]))
    assert (a - b).abs().max() < 1e-4


def test_caller_thread_count_survives_steps(builtin, monkeypatch):
    """The program runs with one torch thread (no OpenMP spin beside XNNPACK's threadpool),
    and the caller's count is back after every call, a failing one included."""
    path, _, _ = builtin
    dec = load_pte(path)
    seen = []
    execute = dec._execute
    monkeypatch.setattr(dec, "_execute", lambda *a: seen.append(torch.get_num_threads()) or execute(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        dec.prefill(torch.tensor([[1, 2, 3]]))
        dec.decode(torch.tensor([4]))
        assert seen == [1, 1] and torch.get_num_threads() == 3
        monkeypatch.setattr(dec, "_execute", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            dec.decode(torch.tensor([5]))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_export_argument_errors(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="quantize"):
        export_pte(model, tmp_path / "x.pte", quantize="int4")
    with pytest.raises(TypeError, match="quantize_embedding must be a bool"):
        export_pte(model, tmp_path / "x.pte", quantize="int8", quantize_embedding="yes")
    with pytest.raises(ValueError, match="quantize_embedding applies with quantize"):
        export_pte(model, tmp_path / "x.pte", quantize_embedding=True)
    with pytest.raises(ValueError, match="prefill_chunk"):
        export_pte(model, tmp_path / "x.pte", prefill_chunk=0)
    with pytest.raises(TypeError, match="full_logits must be a bool"):
        export_pte(model, tmp_path / "x.pte", full_logits=1)
    with pytest.raises(TypeError, match="full_logits must be a bool"):
        export_onnx(model, tmp_path / "x.onnx", full_logits="yes")
    with pytest.raises(ValueError, match="eos_token_id"):
        export_pte(model, tmp_path / "x.pte", eos_token_id=10**6)
    with pytest.raises(ValueError, match="bos_token_id"):
        export_pte(model, tmp_path / "x.pte", bos_token_id=-2)
    with pytest.raises(TypeError, match="parallel must be a bool"):
        export_pte(model, tmp_path / "x.pte", parallel=1)
    with pytest.raises(TypeError, match="parallel must be a bool"):
        export_onnx(model, tmp_path / "x.onnx", parallel="yes")
    for bad in (1, True, 2.0, "5"):
        with pytest.raises(ValueError, match="verify_len must be an int >= 2 or None"):
            export_pte(model, tmp_path / "x.pte", verify_len=bad)
        with pytest.raises(ValueError, match="verify_len must be an int >= 2 or None"):
            export_onnx(model, tmp_path / "x.onnx", verify_len=bad)
        with pytest.raises(ValueError, match="verify_len must be an int >= 2 or None"):
            StaticDecoder(model, verify_len=bad)
    assert not os.listdir(tmp_path)


def test_in_place_quantization_takes_an_export_copy_only():
    """`quantize_weights_` (what `lower_program` runs on its own export copy) refuses a model
    whose experts are not fused, before changing it, and an unknown mode."""
    from shram_static.export.pte import export_copy
    from shram_static.export.quantize import quantize_weights_

    model = tiny_model(num_decoder_layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="fused experts"):
        quantize_weights_(model, "int8")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="quantize must be one of"):
        quantize_weights_(export_copy(model), "int4")


# Drift against fp32 (dynamic per-token int8 activations on every nn.Linear): each quantized
# matmul adds a relative error of about 2^-(bits) of its operands' range, and a flipped expert
# choice moves a token's logits further. The one-layer tiny model's logits are random weights
# (the worst case for low-bit weights); measured max / mean |drift| over a 100-token prompt,
# the experts' linears quantized too: int8 0.078 / 0.011 (argmax agreement 99%); 8da4w with the
# int8 embedding (it moves the router's input, and this model's routing flips on it) 2.09 /
# 0.138 (73%). The bounds leave ~1.5-2x headroom. The lowering itself is checked against the
# same quantization run eagerly.
DRIFT = {("int8", False): (0.12, 0.02), ("8da4w", True): (4.0, 0.25)}


@pytest.mark.parametrize("mode,tied,embedding", [("int8", False, True), ("8da4w", False, True), ("int8", True, True),
                                                 ("int8", False, False)])
def test_quantize_covers_every_linear_and_the_embedding(mode, tied, embedding):
    """Every nn.Linear (lm_head included, its own copy when tied; the experts' fused linears) and,
    when asked, the embedding are quantized, on a copy."""
    from shram_static.export.quantize import Int8Embedding
    model = tiny_model(tie_word_embeddings=tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_weights(model, mode, embedding=embedding)
    lin = {n: m for n, m in q.named_modules() if isinstance(m, torch.nn.Linear)}
    # every nn.Linear of the model, the fused experts' two per layer, a tied head's own
    want = sum(isinstance(m, torch.nn.Linear) for m in model.modules()) + 2 * model.config.num_decoder_layers + tied
    assert "lm_head" in lin and "model.layers.0.attention.sparse_attention.bea.qkv" in lin and len(lin) == want
    plain = [n for n, m in lin.items() if type(m.weight) in (torch.Tensor, torch.nn.Parameter)]
    assert not plain, f"left in float: {plain}"
    if embedding:
        assert isinstance(q.embed_tokens, Int8Embedding) and q.embed_tokens.weight_q.dtype == torch.int8
    else:
        assert type(q.embed_tokens) is torch.nn.Embedding and torch.equal(q.embed_tokens.weight, model.embed_tokens.weight)
    after = model.state_dict()  # the input model is untouched
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert type(model.embed_tokens) is torch.nn.Embedding and (model.lm_head is None) == tied
    with pytest.raises(ValueError, match="quantize must be one of"):
        quantize_weights(model, "int3")


def test_int8_embedding_looks_up_dequantized_rows():
    """Each looked-up row is its int8 row times its scale (a loop over ids), within half a step
    of the float row."""
    from shram_static.export.quantize import Int8Embedding
    emb = torch.nn.Embedding(50, 24)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(50, 24, generator=torch.Generator().manual_seed(1)) * torch.rand(50, 1) * 3)
    q = Int8Embedding(emb)
    ids = torch.tensor([[3, 0, 49, 3], [7, 7, 12, 1]])
    got = q(ids)
    assert got.shape == (2, 4, 24) and got.dtype == torch.float32
    for b in range(2):
        for t in range(4):
            i = int(ids[b, t])
            assert torch.equal(got[b, t], q.weight_q[i].float() * q.scale[i, 0])
            assert (got[b, t] - emb.weight[i]).abs().max() <= 0.51 * q.scale[i, 0]


def test_8da4w_keeps_int8_where_groups_do_not_fit():
    """A layer whose input width is no multiple of 32 keeps int8 weights (XNNPACK's int4 GEMM
    takes only group sizes that are multiples of 32), and so do the experts: they compute
    exactly what the int8 mode's layers compute, while another 32-divisible layer differs (int4)."""
    from helpers import TINY_CONFIG, randomize_
    from shram_static import ShramConfig, ShramForCausalLM
    model = randomize_(ShramForCausalLM(ShramConfig(**dict(TINY_CONFIG, mlp_width=72))), 3)
    q4, q8 = quantize_weights(model, "8da4w"), quantize_weights(model, "int8")
    gen = torch.Generator().manual_seed(0)
    # the experts' linears keep int8 too (int4 experts flip later layers' routing)
    for name, width, int4 in (("mlp.up_proj", 64, True), ("mlp.down_proj", 72, False),
                              ("attention.sparse_attention.bea.qkv", 64, False),
                              ("attention.sparse_attention.bea.o", 128, False)):
        x = torch.randn(2, width, generator=gen)
        m4, m8 = (q.get_submodule(f"model.layers.0.{name}") for q in (q4, q8))
        assert torch.equal(m4(x), m8(x)) != int4, name


@pytest.mark.heavy
@pytest.mark.parametrize("mode,embedding", [("int8", False), ("8da4w", True)])
def test_quantized_program(tmp_path, mode, embedding):
    """Drift of a lowered quantized program against fp32 (eager: the fp32 program equals it to
    1e-4, tests above; not sharing that program lets this test run on another worker). Decode
    only, to halve the lowering: the prompts go token by token through the quantized step."""
    model = tiny_model(num_decoder_layers=1)  # one layer: half the lowering
    et = lower_program(model, batch_size=1, prefill_chunk=None, quantize=mode, eos_token_id=EOS,
                       quantize_embedding=embedding)
    pathq = tmp_path / f"{mode}.pte"
    pathq.write_bytes(et.buffer)
    # What makes the quantized step fast, on the installed stack: every quantized linear
    # (torchao's dynamic quantize / dequantize pattern) inside the XNNPACK delegate, no matmul
    # or quantization op left to portable kernels, and the delegate no more split than the fp32
    # program's (QUANTIZED_DELEGATE_CALLS).
    ops = program_ops(et, "forward")
    kernels = set(ops["kernels"])
    assert ops["backends"] == ["XnnpackBackend"], ops
    assert not {k for k in kernels if k.startswith(("torchao::", "quantized_decomposed::"))}, kernels
    assert not kernels & {"aten::mm.out", "aten::addmm.out", "aten::bmm.out", "aten::linear.out"}, kernels
    assert kernels <= ALLOWED_KERNELS, sorted(kernels - ALLOWED_KERNELS)
    assert ops["delegate_calls"] <= QUANTIZED_DELEGATE_CALLS, ops["delegate_calls"]
    # Smaller than the fp32 bytes it would hold (weights, rope tables, starting state), which a
    # float program exceeds (delegate payloads and graph: a decode-only fp32 tiny program is 1.12x them).
    from shram_static.state import state_bytes
    fp32 = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    fp32 += state_bytes(model.config, 1, 1)
    assert os.path.getsize(pathq) < fp32, (os.path.getsize(pathq), fp32)
    decq, dec32 = load_pte(pathq), StaticDecoder(model, batch_size=1, prefill_chunk=8)
    assert decq.meta["quantize"] == mode and decq.meta["quantize_embedding"] == embedding
    max_drift, mean_drift = DRIFT[mode, embedding]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 100), generator=gen)
    lq, l32 = decq.prefill(ids), dec32.prefill(ids)
    drift = (lq - l32).abs()
    print(mode, "drift max", drift.max().item(), "mean", drift.mean().item(),
          "argmax agreement", (lq.argmax(-1) == l32.argmax(-1)).float().mean().item())
    assert drift.max() <= max_drift and drift.mean() <= mean_drift, (drift.max(), drift.mean())
    # the program computes what torchao's quantized model computes eagerly (uncached forward)
    eager = quantize_weights(model, mode, embedding=embedding)(ids).logits
    lowered = (lq - eager).abs()
    print(mode, "program vs eager quantized: max", lowered.max().item(), "mean", lowered.mean().item())
    assert lowered.mean() <= 0.1 * mean_drift, (lowered.max(), lowered.mean())
    if mode == "8da4w":  # its drift bound exceeds most top-1/top-2 margins of this model:
        return  # comparing greedy tokens below would check nothing
    # greedy tokens: identical wherever fp32's top-1/top-2 margin exceeds twice the drift
    # bound (below it a flip is within the accepted error, not a bug)
    tok = ByteTokenizer()
    for prompt in ("Hello world", "The quick brown fox", "int8 test"):
        x = torch.tensor([tok.encode(prompt)])
        t32 = dec32.generate(x, max_new_tokens=20, eos_token_id=-1)[0]
        tq = decq.generate(x, max_new_tokens=20, eos_token_id=-1)[0]
        # teacher-force fp32's tokens through both to get each step's fp32 margin
        dec32.reset()
        full = torch.cat([x[0], t32[:-1]])[None]
        lg = dec32.prefill(full)[0, x.shape[1] - 1:]
        top2 = lg.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        close = margin <= 2 * max_drift
        first_close = int(close.nonzero()[0]) if bool(close.any()) else 20
        assert torch.equal(tq[:first_close], t32[:first_close]), (prompt, tq, t32, margin)


def test_rollback_and_speculation_without_a_verify_method(builtin):
    """A program exported without a verify step still rolls back up to its prefill chunk (the
    limit is in its metadata), exactly as eager does; speculation verifies through prefill and
    gives plain greedy's tokens."""
    path, _, model = builtin
    dec, ref = load_pte(path), StaticDecoder(model, 1, 8, verify_len=None)
    assert dec.rollback_limit == 8 and dec.verify_len is None
    ids = torch.tensor([[72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32, 72]])
    for d in (dec, ref):
        d.prefill(ids)
        d.rollback(6)
        with pytest.raises(ValueError, match="at most 2"):
            d.rollback(3)
    assert (dec.decode(torch.tensor([33])) - ref.decode(torch.tensor([33]))).abs().max() < 1e-4
    assert torch.equal(dec.generate(ids, max_new_tokens=24, speculate=3), ref.generate(ids, max_new_tokens=24))


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_linear_only_program_of_the_benchmark(quantize):
    """`benchmarks/pte_linears.py` lowers a program of the exported step's linear layers alone:
    every nn.Linear of the export copy (the fused experts included), quantized as `export_pte`
    quantizes, counted at their stored bytes, each output's mean as the module
    computes it; and its op chains run the ops they count."""
    from executorch.runtime import Runtime

    from helpers import load_benchmark
    from shram_static.export.common import export_copy

    bench = load_benchmark("pte_linears")
    model = tiny_model(num_decoder_layers=1)
    linears, nbytes = bench.linear_layers(model, quantize)
    plain = [m for m in export_copy(model).modules() if isinstance(m, torch.nn.Linear)]
    assert [lin.weight.shape for lin in linears] == [lin.weight.shape for lin in plain]
    weights = sum(lin.weight.numel() for lin in plain)
    scales = sum(lin.out_features for lin in plain)  # one per output channel
    assert nbytes == (4 * weights if quantize is None else weights + scales * 4 + scales)  # int8 zero points
    buf, xs = bench.lower_linears(linears)
    got = Runtime.get().load_program(buf).load_method("forward").execute(xs)[0]
    with torch.no_grad():
        want = bench.Linears(linears)(*xs)
    assert got.shape == (len(linears),)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    if quantize is None:
        for name, (method, _), x, ops in bench.op_chains(20):
            assert ops == 20, name
            assert method.execute(x)[0].shape == x[0].shape


def test_parts_benchmark_takes_out_each_part():
    """`benchmarks/pte_parts.py` exports the decode step with one part taken out: each variant's
    program lacks what that part runs (so a patch that stopped applying cannot report a part as
    free)."""
    from helpers import load_benchmark

    bench = load_benchmark("pte_parts")
    model = tiny_model(num_decoder_layers=1)

    def ops(part):
        with bench.PARTS[part]() if part else contextlib.nullcontext():
            et = lower_program(model, prefill_chunk=None, parallel=False)
        delegated = collections.Counter(name for name, _ in delegated_ops(et, "forward"))
        return program_ops(et, "forward")["kernels"], delegated

    kernels, delegated = ops(None)
    assert "aten::index_select.out" in kernels and "aten::topk.values" in kernels
    assert delegated["sqrt"] > 0 and delegated["_softmax"] == 2  # entmax; both attentions
    k, d = ops("attention")
    assert d["_softmax"] == 0 and d["bmm"] < delegated["bmm"] and "aten::index_select.out" not in k
    k, d = ops("gathers")
    assert "aten::index_select.out" not in k and d["_softmax"] == 2
    k, d = ops("routing")
    assert "aten::topk.values" not in k and d["sqrt"] == 0
    k, d = ops("entmax")
    assert "aten::topk.values" in k and d["sqrt"] == 0 and d["_softmax"] == 3
