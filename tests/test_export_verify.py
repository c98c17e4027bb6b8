"""The exported verify step (`export_pte(verify_len=...)`: a `verify` method; `export_onnx(...,
verify_len=...)`: `m.verify.onnx`): the same logits as eager through verify, rollback and
decode, and speculative greedy decoding on the exported program gives plain greedy's tokens.
Decode-only exports plus the verify step (one lowering fewer than with a prefill method)."""

import pytest
import torch

from helpers import random_ids, tiny_model
from shram_static import StaticDecoder
from shram_static.export import export_onnx, export_pte, load_onnx, load_pte


def check_verify_backend(dec, model):
    assert dec.rollback_limit == 4 and dec.verify_len == 4
    ref = StaticDecoder(model, 1, 1, verify_len=4)
    ids = random_ids(model.config, 1, 14, seed=3)
    ids = torch.cat([ids, ids[:, :6]], 1)
    for d in (dec, ref):
        d.prefill(ids[:, :9])
    torch.testing.assert_close(dec.verify(ids[:, 9:13]), ref.verify(ids[:, 9:13]), atol=1e-4, rtol=1e-4)
    dec.rollback(3)
    ref.rollback(3)
    torch.testing.assert_close(dec.decode(ids[:, 5]), ref.decode(ids[:, 5]), atol=1e-4, rtol=1e-4)
    want = ref.generate(ids, max_new_tokens=30)
    assert torch.equal(dec.generate(ids, max_new_tokens=30, speculate=3), want)


@pytest.mark.heavy
def test_pte_verify_method(tmp_path):
    model = tiny_model()
    dec = load_pte(export_pte(model, tmp_path / "m.pte", prefill_chunk=None, verify_len=4))
    assert "verify" in dec.method_names and dec.meta["verify_method"] == "verify"
    check_verify_backend(dec, model)


@pytest.mark.heavy
def test_onnx_verify_graph(tmp_path):
    model = tiny_model()
    paths = export_onnx(model, tmp_path / "m.onnx", prefill_chunk=None, verify_len=4)
    assert sorted(paths) == ["data", "decode", "verify"]
    check_verify_backend(load_onnx(paths["decode"]), model)
