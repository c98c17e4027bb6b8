"""The arguments `export_pte`, `export_onnx` and `StaticDecoder` refuse before tracing anything,
each with an error that names it, and no file written."""

import os

import pytest

from helpers import tiny_model

from shram_static import StaticDecoder
from shram_static.export import export_onnx, export_pte


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
    for bad in (True, 0, 1.0):  # one check for the exporters and the decoders (a bool is no size)
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            export_onnx(model, tmp_path / "x.onnx", batch_size=bad)
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            export_pte(model, tmp_path / "x.pte", batch_size=bad)
    assert not os.listdir(tmp_path)
