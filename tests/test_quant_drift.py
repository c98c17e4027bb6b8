"""Quantization's logit drift on a trained model: the built-in model, quantized as `export_pte`
quantizes it (`quantize_weights`, run eagerly; tests/test_export_quantized.py checks that the lowered
program computes what this eager model computes), against fp32 on a Shakespeare prompt.

A random-weight model is the worst case for low-bit weights (test_export_quantized.py bounds that);
this bounds what a user of the shipped weights sees. Measured max / mean |drift| and argmax
agreement over the prompt's 105 positions: int8 0.50 / 0.057 (99%), int8 with the int8
embedding 0.34 / 0.053 (98%), 8da4w 2.13 / 0.34 (92%), 8da4w with the int8 embedding
2.16 / 0.34 (93%); the bounds leave ~1.5x headroom.
"""

import pytest
import torch

from shram_static.default_model import default_model
from shram_static.export.quantize import quantize_weights
from shram_static.tokenizer import ByteTokenizer

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."
# (mode, embedding) -> (max |drift|, mean |drift|, least argmax agreement)
BOUNDS = {("int8", False): (0.75, 0.09, 0.95), ("int8", True): (0.6, 0.09, 0.95),
          ("8da4w", False): (3.2, 0.5, 0.85), ("8da4w", True): (3.2, 0.5, 0.85)}


@pytest.fixture(scope="module")
def builtin():
    """(fp32 built-in model, prompt ids, its fp32 logits)."""
    model = default_model()
    ids = torch.tensor([ByteTokenizer().encode(TEXT)])
    with torch.no_grad():
        return model, ids, model(ids).logits[0]


@pytest.mark.parametrize("mode,embedding", list(BOUNDS))
def test_quantized_builtin_model_drifts_within_bounds(builtin, mode, embedding):
    model, ids, ref = builtin
    with torch.no_grad():
        q = quantize_weights(model, mode, embedding=embedding)(ids).logits[0]
    d = (q - ref).abs()
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    max_drift, mean_drift, least_agree = BOUNDS[mode, embedding]
    assert d.max() <= max_drift and d.mean() <= mean_drift and agree >= least_agree, (d.max(), d.mean(), agree)
    assert d.max() > 0  # it was quantized at all
