"""Streaming: `TextTokenStreamer` writes text as tokens arrive (whole UTF-8 characters only),
from transformers' generate(), `HostDecoder.generate` and the `generate` command."""

import sys

import pytest
import torch
from helpers import random_ids, random_model

from shram_static import StaticDecoder
from shram_static.cli import main
from shram_static.default_model import default_model
from shram_static.generation import TextTokenStreamer
from shram_static.tokenizer import ByteTokenizer


class Recorder:
    """A text stream that keeps each write."""

    def __init__(self):
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return len(s)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(self.writes)


def test_multibyte_characters_are_written_whole_and_at_once():
    tok = ByteTokenizer()
    text = "hé €x\U0001F600!"
    stream = Recorder()
    s = TextTokenStreamer(tok, stream, eos_token_id=tok.eos_token_id)
    s.put(torch.tensor([tok.encode("prompt")]))
    assert stream.text == ""  # the prompt is not echoed
    shown = []
    for b in text.encode("utf-8"):
        s.put(torch.tensor([b]))
        shown.append(stream.text)
    # Each character appears with its last byte, never as a replacement character.
    assert "\ufffd" not in stream.text
    assert shown[0] == "h"
    assert shown[1] == "h" and shown[2] == "hé"  # é is 2 bytes
    s.put(torch.tensor([tok.eos_token_id]))
    s.put(torch.tensor([ord("z")]))  # after EOS: dropped
    s.end()
    assert stream.text == text + "\n" == tok.decode(list(text.encode("utf-8"))) + "\n"


def test_invalid_bytes_end_as_the_tokenizer_decodes_them():
    tok = ByteTokenizer()
    stream = Recorder()
    s = TextTokenStreamer(tok, stream)
    s.put(torch.tensor([[1]]))
    ids = [ord("a"), 0xE2, 0x82, ord("b"), 0xC3]
    for i in ids:
        s.put(torch.tensor([i]))
    s.end()
    assert stream.text == tok.decode(ids) + "\n"


def test_batches_are_rejected():
    s = TextTokenStreamer(ByteTokenizer(), Recorder())
    s.put(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="one sequence"):
        s.put(torch.tensor([1, 2]))


class LetterTokenizer:
    """Token i -> one letter (an independent decode for a model of any vocabulary)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def test_transformers_generate_and_host_decoder_stream():
    model = random_model(31)
    ids = random_ids(model.config, 1, 5, seed=16)
    out = model.generate(ids, max_new_tokens=9, do_sample=False)
    want = LetterTokenizer().decode(out[0, 5:].tolist()) + "\n"
    stream = Recorder()
    model.generate(ids, max_new_tokens=9, do_sample=False, streamer=TextTokenStreamer(LetterTokenizer(), stream))
    assert stream.text == want
    assert len(stream.writes) == 9 + 1  # one write per token, then the newline
    stream = Recorder()
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=4)
    dec.generate(ids, max_new_tokens=9, streamer=TextTokenStreamer(LetterTokenizer(), stream))
    assert stream.text == want and len(stream.writes) == 10


def test_cli_streams_the_same_text(monkeypatch, capsys):
    tok = ByteTokenizer()
    dec = StaticDecoder(default_model(), batch_size=1)
    new = dec.generate(torch.tensor([tok.encode("Hello")]), max_new_tokens=12, eos_token_id=tok.eos_token_id)[0]
    new = new.tolist()
    if tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id)]
    stream = Recorder()
    monkeypatch.setattr(sys, "stdout", stream)
    assert main(["generate", "--prompt", "Hello", "--max-new-tokens", "12"]) == 0
    assert stream.text == tok.decode(new) + "\n"
    assert len(stream.writes) > 2  # written piece by piece, not once at the end
    assert "new tokens" in capsys.readouterr().err
