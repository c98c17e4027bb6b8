"""The byte tokenizer, its tokenizer.json, and checkpoint tokenizer selection."""

import json
import os
import random

import pytest

from shram_static.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = [
    "Hello",
    "",
    " leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld, ça va? Øre ß",
    "日本語のテキスト 中文 한국어",
    "emoji 🎉👩‍👩‍👧 and math ∑∫√",
    "\x00\x01\x7f control bytes",
    "don't 'quote' \"me\" <html> & {json: [1, 2]}",
]


def _random_texts(n=30, seed=0):
    rng = random.Random(seed)
    pools = [range(32, 127), range(0x00A0, 0x0800), range(0x3040, 0x30FF), range(0x1F300, 0x1F64F),
             range(0, 32)]
    out = []
    for _ in range(n):
        chars = [chr(rng.choice(rng.choice(pools))) for _ in range(rng.randint(1, 40))]
        out.append("".join(chars))
    return out


def test_ids():
    tok = ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.encode("Hi") == [256, 72, 105]
    assert tok.encode("Hi", add_bos=False) == [72, 105]
    assert tok.encode("é", add_bos=False) == [0xC3, 0xA9]
    assert tok.encode("") == [256]


@pytest.mark.parametrize("text", TEXTS + _random_texts())
def test_round_trip(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_specials_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([256, 72, 257, 105, 258]) == "Hi"
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    assert tok.decode([0xC3]) == "\ufffd"  # truncated multi-byte sequence
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    ByteTokenizer().save(d)
    return d


def test_tokenizer_json_shape(saved):
    spec = json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["type"] == "BPE" and spec["model"]["merges"] == []
    assert sorted(spec["model"]["vocab"].values()) == list(range(256))
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["decoder"]["type"] == "ByteLevel"
    assert spec["pre_tokenizer"]["add_prefix_space"] is False and spec["pre_tokenizer"]["use_regex"] is False
    added = {t["id"]: t for t in spec["added_tokens"]}
    assert sorted(added) == [256, 257, 258] and all(t["special"] for t in added.values())
    assert spec["post_processor"]["type"] == "TemplateProcessing"


@pytest.mark.parametrize("text", TEXTS + _random_texts(seed=1))
def test_tokenizers_library_agrees(saved, text):
    """The `tokenizers` library reading our tokenizer.json gives the byte tokenizer's ids."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(saved / "tokenizer.json"))
    tok = ByteTokenizer()
    assert hf.encode(text).ids == tok.encode(text)  # the template adds BOS
    assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text, add_bos=False)
    assert hf.decode(tok.encode(text) + [tok.eos_token_id]) == text
    assert hf.get_vocab_size() == tok.vocab_size


def test_load_tokenizer_picks_tokenizer_json(saved, tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # no tokenizer.json there
    hf = load_tokenizer(saved)
    assert isinstance(hf, HFTokenizer)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.vocab_size) == (256, 257, 258, 259)
    tok = ByteTokenizer()
    for text in TEXTS + _random_texts(10, seed=2):
        assert hf.encode(text) == tok.encode(text)
        assert hf.encode(text, add_bos=False) == tok.encode(text, add_bos=False)
        assert hf.decode(tok.encode(text) + [257, 258]) == text


def test_bare_tokenizer_json_finds_specials(saved, tmp_path):
    """Without tokenizer_config.json, BOS comes from the template and EOS/PAD from the names."""
    (tmp_path / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes())
    hf = load_tokenizer(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)


def test_another_tokenizer_json_is_used(tmp_path):
    """A checkpoint's own (non-byte) tokenizer is what load_tokenizer returns."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<s>", "</s>"])
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    hf = load_tokenizer(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert hf.encode("hello world") == [1, 3, 4]
    assert hf.encode("hello zzz", add_bos=False) == [3, 0]
    assert hf.decode([1, 3, 4, 2]) == "hello world"


def test_broken_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_executorch_tokenizer_reads_specials(saved):
    """ExecuTorch's Python HF tokenizer finds BOS/EOS in our file with no config (its guess)."""
    hf_mod = pytest.importorskip("pytorch_tokenizers.hf_tokenizer")
    t = hf_mod.HuggingFaceTokenizer(os.path.join(saved, "tokenizer.json"))
    assert (t.bos_id, t.eos_id) == (256, 257)
    assert t.encode("héllo", bos=True, eos=False) == ByteTokenizer().encode("héllo")
