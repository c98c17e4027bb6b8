"""The web site's module on its own (no export): fast-check properties of its sampler and
tokenizers (`node --test tests/web/`), its sampler against `sampling.Sampler`, its byte-level
BPE against `tokenizers`, and the dequantized MatMuls a quantized site's row-writes graphs run.
"""

import json
import shutil
import subprocess

import onnx
import pytest
import torch
from test_web import ROOT, need, need_node, run_node

from shram_static.tokenizer import HFTokenizer


@pytest.mark.parametrize("pre", ["byte_level", "prefix_space", "split_then_byte_level"])
def test_tokenizer_json_bpe_matches_hf(tmp_path, pre):
    """The module's byte-level BPE against `tokenizers` (through HFTokenizer) on a tokenizer
    trained here, with merges, an added special token and multi-byte text."""
    need(shutil.which("node") is not None, "node is not installed")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tk = Tokenizer(models.BPE())
    if pre == "split_then_byte_level":  # a split by a regex of its own first (Llama-3 style)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=pre == "prefix_space")
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["First Citizen: Before we proceed any further, hear me speak.", "All: Speak, speak.",
              "Grüße aus Köln, naïve café", "日本語のテキスト 123 456"] * 20
    tk.train_from_iterator(corpus, trainer)
    tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                      special_tokens=[("<|begin_of_text|>", 1)])
    tk.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    texts = ["First Citizen: speak, speak!", "  leading spaces and 42 numbers", "Grüße 日本 🙂 café",
             "a<|endoftext|>b", "x\n\ny  z\t"]
    info = {"type": "tokenizer.json", "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id,
            "vocab_size": hf.vocab_size}
    (tmp_path / "info.json").write_text(json.dumps(info))
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    res = run_node("tokenize", ROOT / "shram_static" / "web" / "shram.mjs", tmp_path / "info.json",
                   tmp_path / "tokenizer.json", tmp_path / "texts.json")
    for t, r in zip(texts, res):
        assert r["ids"] == hf.encode(t), t
        assert r["text"] == hf.decode(r["ids"]), t


def test_js_property_tests():
    """tests/web/*.test.mjs: fast-check properties of the module's sampler and tokenizers."""
    need_node()
    need((ROOT / "node_modules" / "fast-check").is_dir(), "node_modules lacks fast-check: run npm ci")
    r = subprocess.run(["node", "--test", str(ROOT / "tests" / "web")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "# fail 0" in r.stdout


def mulberry32(seed: int):
    """The page's seed rule (shram.mjs `seededRandom`), written here from its definition: 32-bit
    unsigned arithmetic, uniform floats in [0, 1)."""
    m = 0xFFFFFFFF
    a = seed & m
    while True:
        a = (a + 0x6D2B79F5) & m
        t = ((a ^ (a >> 15)) * (a | 1)) & m
        t ^= (t + (((t ^ (t >> 7)) * (t | 61)) & m)) & m
        yield ((t ^ (t >> 14)) & m) / 2 ** 32


def test_js_sampler_matches_python(tmp_path):
    """The module's sampler against `sampling.Sampler` on the same float32 logits: the same
    distribution (float64) at every temperature, tiny ones included, with top-k and top-p; and
    the same tokens as Python drawing by inverse CDF from its own distribution with the page's
    seed rule."""
    need(shutil.which("node") is not None, "node is not installed")
    import numpy as np

    from shram_static.sampling import Sampler
    g = torch.Generator().manual_seed(0)
    cases = []
    for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 40, 0.95), (1.3, 0, 0.9), (0.05, 5, 1.0), (1e-308, 0, 1.0),
                                   (5e-324, 40, 0.95), (1e-300, 0, 0.5), (3.0, 1, 1.0), (1e-3, 0, 1.0)]):
        logits = (torch.randn(259, generator=g) * (2 + i)).float()
        cases.append({"logits": logits.tolist(), "settings": {"temperature": t, "topK": k, "topP": p},
                      "seed": 1000 + i, "n": 50})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    got = run_node("sample", ROOT / "shram_static" / "web" / "shram.mjs", tmp_path / "cases.json")
    for c, r in zip(cases, got):
        s = c["settings"]
        want = Sampler(s["temperature"], s["topK"] or None, s["topP"]).probs(torch.tensor(c["logits"]))
        np.testing.assert_allclose(r["probs"], want.numpy(), rtol=1e-9, atol=1e-15, err_msg=str(s))
        cdf = np.cumsum(want.numpy())
        u = mulberry32(c["seed"])
        assert r["ids"] == [int(min(np.searchsorted(cdf, next(u), side="right"), len(cdf) - 1))
                            for _ in range(c["n"])], s
        if s["temperature"] < 1e-200:  # tiny temperatures are greedy, as in Python
            assert set(r["ids"]) == {int(torch.tensor(c["logits"]).argmax())}


@pytest.mark.parametrize("bits,k", [(4, 64), (4, 40), (8, 96)])
def test_dequantized_matmuls_compute_what_matmulnbits_computes(tmp_path, bits, k):
    """`dequantized_matmuls` (what a quantized site's row-writes graphs run) against onnxruntime's
    own MatMulNBits on the same packed weights with float compute (accuracy level 0), K a
    multiple of the block and not; onnxruntime folds the dequantization at load."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from shram_static.export.onnx_quantize import dequantized_matmuls, quantize_graph
    n = 48
    w = np.random.default_rng(bits + k).standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
                          [numpy_helper.from_array(w, "w")])
    q, count = quantize_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]),
                              "int4" if bits == 4 else "int8")
    assert count == 1
    for node in q.graph.node:  # the oracle computes in float too
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    onnx.save(q, str(tmp_path / "nbits.onnx"))
    d, rewritten = dequantized_matmuls(onnx.load(str(tmp_path / "nbits.onnx")))
    assert rewritten == 1 and "MatMulNBits" not in [x.op_type for x in d.graph.node]
    onnx.save(d, str(tmp_path / "dq.onnx"))
    onnx.checker.check_model(str(tmp_path / "dq.onnx"))
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    want = ort.InferenceSession(str(tmp_path / "nbits.onnx")).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(tmp_path / "dq.onnx"), so).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - x @ w).max() > 1e-4  # the weights were quantized


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_web_linears_chain_multiplies_its_weights_in_turn(kind):
    """`benchmarks/web_linears.py --chain N`: N linears one after another, (k, n) then (n, k),
    each with weights of its own; onnxruntime's output is x times each weight in turn (the int8
    graph's within its rounding)."""
    import numpy as np
    import onnxruntime as ort
    from helpers import load_benchmark

    model = load_benchmark("web_linears").linear_model(kind, 8, 24, chain=3)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    ws = [inits[f"W{i}"] * (inits[f"S{i}"] if kind == "int8" else 1) for i in range(3)]
    assert [w.shape for w in ws] == [(8, 24), (24, 8), (8, 24)]
    assert len({w.tobytes() for w in ws}) == 3  # weights of their own
    x = np.sin(np.arange(8, dtype=np.float32))[None]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ ws[0] @ ws[1] @ ws[2]
    np.testing.assert_allclose(got, want, rtol=0.05 if kind == "int8" else 1e-5, atol=0.05 * np.abs(want).max())
