"""ExecuTorch export (`export_pte` / `load_pte`): golden logits and tokens, the stock
`TextLLMRunner`, graph contents, initial state, bad artifacts and host validation (quantized
programs: test_export_quantized.py; the benchmarks' programs: test_pte_benchmarks.py).

Slow: every program is lowered through XNNPACK (tens of seconds per method of a 2-layer model
on two cores), so each artifact is built once per module and shared by the tests that
read it, and a test that needs no prefill method lowers a decode-only program
(`prefill_chunk=None`, the artifact ExecuTorch's stock runner uses). The prefill method is
checked on the shared program of one golden case (golden logits, and chunks with dead tokens
against StaticDecoder); batched prefill with left padding on every other backend, ONNX included.
"""

import json
import os
import warnings

import pytest
import torch

from helpers import (ALLOWED_KERNELS, GOLDEN_CASES, check_last_token_prefill, check_prefix_steps, check_verify_step,
                     delegated_ops, golden_case, golden_run, program_ops, tiny_model)

from shram_static import StaticDecoder
from shram_static.accelerators import enabled
from shram_static.console import LEAFSPEC_NOTICE, MUTABLE_BUFFER_NOTICE
from shram_static.export import ExportFormatError, export_pte, load_pte
from shram_static.accelerators.forked import can_fork
from shram_static.export.pte import lower_program
from shram_static.tokenizer import ByteTokenizer, bytes_to_unicode


EOS, BOS = ByteTokenizer.eos_token_id, ByteTokenizer.bos_token_id

# Recorded on the shared program (2 layers, L = 8, K = 2, batch 1, chunk 8; the tiny test model,
# which has the same layer structure, gives the same counts): portable-kernel calls, XNNPACK
# delegate calls and the share of ops left to portable kernels, portable / (portable +
# delegated). What is left outside the delegates is routing (topk, the block solver's
# comparisons), the index bookkeeping of the cache writes and reads and dtype casts, none of which XNNPACK
# takes (docs/design.md, "How each backend runs the step").
# Lower them when the graph improves; a rise (a new portable op splitting a delegate) fails.
RECORDED = {"forward": {"portable": 172, "delegate_calls": 9, "share": 0.311},
            "prefill": {"portable": 299, "delegate_calls": 13, "share": 0.406}}
# Kernels the decode step must never run: expand_copy is what a >2-D matmul left to portable
# kernels becomes, a copy of a whole gathered cache or expert block per layer and token.
FORBIDDEN_IN_DECODE = {"aten::expand_copy.out"}


# The golden case (batch 1) whose program, with a prefill method and BOS/EOS, is shared by its
# golden check and by every test of the program's contract below: one lowering fewer.
SHARED_CASE = "yarn_extended"


# Methods of the shared program that came back from a forked lowering (`lower_in_parallel`).
TRANSFERRED = []


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """(path, ExecutorchProgramManager, model) of the SHARED_CASE golden model, batch 1, chunk 8.

    Lowered as `export_pte` does by default: the decode method in a forked process where the
    machine allows; a failed child (whose method would be lowered again here) is an error, and so
    are torch's LeafSpec notice and ExecuTorch's mutable-buffer notice, which lowering drops (in
    either process)."""
    from shram_static.accelerators import edge_transfer

    model, _ = golden_case(SHARED_CASE)
    received = edge_transfer.edge_program_from_value
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.filterwarnings("error", message="the parallel process", category=RuntimeWarning)
        warnings.filterwarnings("error", message=LEAFSPEC_NOTICE, category=FutureWarning)
        warnings.filterwarnings("error", message=MUTABLE_BUFFER_NOTICE, category=UserWarning)
        mp.setattr(edge_transfer, "edge_program_from_value", lambda v: TRANSFERRED.append(1) or received(v))
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
def test_last_token_prefill_and_verify_methods(tmp_path, monkeypatch):
    """The default export (`full_logits=False`) with a verify method as wide as its prefill
    chunk: `prefill` returns each row's last live token's logits, [B, 1, V], and verification
    runs `verify`, not `prefill` (`check_last_token_prefill`); verify, per-row rollback and
    speculative generation against the eager decoder (`check_verify_step`). `verify` attends
    every expert's cache where it lies, as `prefill` does (no cache gathered per query). Each
    step method attends a prefix of the sparse caches, of a length the runner picks per step
    (`check_prefix_steps`), with allowlisted kernels only."""
    model = tiny_model(num_decoder_layers=1, training_sequence_length=64)  # one layer: half the export
    et = lower_program(model, batch_size=3, prefill_chunk=4, verify_len=4, prefix_lengths=(4, 8))
    (tmp_path / "m.pte").write_bytes(et.buffer)
    dec = load_pte(str(tmp_path / "m.pte"))
    assert dec.meta["full_logits"] is False and dec.meta["verify_method"] == "verify"
    assert dec.meta["prefix_lengths"] == [4, 8, 20] and dec.meta["slots_methods"] == ["decode", "prefill", "verify"]
    for method in ("decode", "prefill", "verify"):
        kernels = program_ops(et, method)["kernels"]
        assert set(kernels) <= ALLOWED_KERNELS, f"{method}: {sorted(set(kernels) - ALLOWED_KERNELS)}"
        assert method == "decode" or "aten::index_select.out" not in kernels, method
    check_last_token_prefill(dec, model)
    check_verify_step(dec, model)
    check_prefix_steps(dec, model, monkeypatch)


# Decode-only programs of the golden cases but the shared one (the stock lowering: a random
# model in tests/test_accelerators.py).
DECODE_ONLY_CASES = [c for c in GOLDEN_CASES if c != SHARED_CASE]


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

    from shram_static.accelerators.registry import STOCK_ENV, unverified
    from shram_static.accelerators.backend_options import weight_cache_enabled

    def steps(d):
        return [d.prefill(torch.arange(1, 12)[None]), d.decode(torch.tensor([5])), d.decode(torch.tensor([7]))]

    got = steps(load_pte(builtin[0]))  # this process: the accelerator as the environment says
    if unverified("xnnpack_weight_cache"):  # another ExecuTorch: stock, nothing to compare
        assert not weight_cache_enabled()
        return
    if os.environ.get(STOCK_ENV, "").strip() in ("", "0"):
        assert weight_cache_enabled()
    code = ("import sys, torch; from shram_static.export import load_pte; "
            "from shram_static.accelerators.backend_options import weight_cache_enabled; "
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
