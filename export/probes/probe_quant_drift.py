"""Logit drift of the quantization modes against fp32 on the golden prompts.

For each golden case (tests/data/<case>) and mode, runs the uncached forward of the model
quantized by `shram_static.export.quantize.quantize_weights` (what `export_pte(...,
quantize=mode, quantize_embedding=emb)` lowers; tests/test_export_pte.py checks the lowered
program against it) and of the fp32 model, and reports over the live positions: max |logit
diff|, mean |diff|, and argmax agreement. Also the built-in model on a Shakespeare slice.

    python export/probes/probe_quant_drift.py
"""

import os
import sys

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "tests", "data")

from shram_static import ShramForCausalLM  # noqa: E402
from shram_static.export.quantize import quantize_weights  # noqa: E402


def drift(model, ids, mask, mode, embedding):
    with torch.no_grad():
        ref = model(ids, mask).logits[mask]
        q = quantize_weights(model, mode, embedding=embedding)(ids, mask).logits[mask]
    d = (q - ref).abs()
    return d.max().item(), d.mean().item(), (q.argmax(-1) == ref.argmax(-1)).float().mean().item(), ref.abs().max().item()


def main() -> int:
    rows = []
    for case in ("main_basic", "semantic_tied", "yarn_extended", "left_padded"):
        path = os.path.join(DATA, case)
        model = ShramForCausalLM.from_pretrained(path)
        g = load_file(os.path.join(path, "golden.safetensors"))
        rows.append((case, model, g["input_ids"], g["attention_mask"].bool()))
    from shram_static.default_model import default_model
    from shram_static.tokenizer import ByteTokenizer
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."
    rows.append(("builtin", default_model(), torch.tensor([ByteTokenizer().encode(text)]), None))
    print(f"{'case':>14} {'mode':>6} {'emb':>5} {'max|d|':>8} {'mean|d|':>8} {'argmax':>7} {'max|logit|':>10}")
    for case, model, ids, mask in rows:
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask
        for mode, emb in (("int8", False), ("int8", True), ("8da4w", False), ("8da4w", True)):
            mx, mean, agree, span = drift(model, ids, mask, mode, emb)
            print(f"{case:>14} {mode:>6} {'int8' if emb else 'float':>5} {mx:8.4f} {mean:8.4f} {agree:7.1%} "
                  f"{span:10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
