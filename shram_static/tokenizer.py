"""Tokenizers: the built-in byte-level tokenizer and checkpoints' own `tokenizer.json`.

`ByteTokenizer.save(dir)` writes an HF `tokenizer.json` (byte-level BPE with no merges: id ==
byte value) that `tokenizers`, `transformers` and ExecuTorch's runner read the same way.
"""

import json
import os

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Names that ExecuTorch's Python HF tokenizer guesses for BOS/EOS when given no config file.
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|begin_of_text|>", "<|endoftext|>", "<|pad|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (used by ByteLevel)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))  # printable bytes: themselves
    rest = [b for b in range(256) if b not in bs]  # the others: 256, 257, ... in byte order
    return {**{b: chr(b) for b in bs}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


# A model for the byte tokenizer may pad its vocabulary up to the next multiple of this (untrained ids).
BYTE_VOCAB_PADDING = 128


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are the bytes, then BOS, EOS and PAD (259 ids).

    Args:
        model_vocab: the model's vocabulary, when padded beyond 259 ids: padding ids decode to nothing.
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def __init__(self, model_vocab: int | None = None):
        self.model_vocab = max(model_vocab or 0, self.vocab_size)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Returns the UTF-8 bytes of `text` as ids, after BOS when `add_bos`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids) -> str:
        """Decodes ids to text: special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.model_vocab:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary [0, {self.model_vocab})")
            if i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        """The HF `tokenizer.json` content equivalent to this tokenizer."""
        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        specials = [(BOS_TOKEN, self.bos_token_id), (EOS_TOKEN, self.eos_token_id),
                    (PAD_TOKEN, self.pad_token_id)]
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for s, i in specials],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [self.bos_token_id],
                                               "tokens": [BOS_TOKEN]}},
            },
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []},
        }

    def save(self, directory) -> None:
        """Writes `tokenizer.json` (and a `tokenizer_config.json` naming the special tokens)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, ensure_ascii=False, indent=1)
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
               "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "add_bos_token": True,
               "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000_000}
        with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=1)


class HFTokenizer:
    """A checkpoint's `tokenizer.json` (`transformers.PreTrainedTokenizerFast`) behind the
    `ByteTokenizer` interface, special tokens from its `tokenizer_config.json` or else guessed.

    Args:
        directory: the checkpoint directory.
    """

    def __init__(self, directory):
        from transformers import PreTrainedTokenizerFast

        path = os.path.join(directory, TOKENIZER_FILE)
        spec = _read_json(path, "is not a readable tokenizer.json")
        special = _special_tokens_from_config(directory) or _guess_special_tokens(spec)
        try:
            self.tok = PreTrainedTokenizerFast(tokenizer_file=path, clean_up_tokenization_spaces=False,
                                               **special)
        except Exception as e:  # tokenizers raises its own Exception subclass on bad files
            raise ValueError(f"{path} could not be loaded as a tokenizer: {e}") from e
        self.bos_token_id = self.tok.bos_token_id
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text` (no template specials), after BOS when `add_bos` and one is known."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return [self.bos_token_id] + ids if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids) -> str:
        """Decodes ids to text, skipping special tokens."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True,
                               clean_up_tokenization_spaces=False)


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} {what}: {e}") from e


def _special_tokens_from_config(directory: str) -> dict:
    path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    cfg = _read_json(path, "is not valid JSON")
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = cfg.get(key)
        if isinstance(value, dict):  # AddedToken serialisation
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _guess_special_tokens(spec: dict) -> dict:
    """bos (the post-processor's leading special token), eos, pad (added tokens so named)."""
    out = {}
    post = spec.get("post_processor") or {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0]
            if "SpecialToken" in first:
                out["bos_token"] = first["SpecialToken"]["id"]
                break
    hints = {"bos_token": ("bos", "<s>", "begin_of_text", "startoftext"),
             "eos_token": ("eos", "</s>", "end_of_text", "endoftext"),
             "pad_token": ("pad",)}
    for text in (t.get("content", "") for t in spec.get("added_tokens", []) if t.get("special")):
        for key, words in hints.items():
            if key not in out and any(w in text.lower() for w in words):
                out[key] = text
    return out


class TokenIdsOnly:
    """No tokenizer: a model served by token ids alone (`serve --token-ids-only`); `encode` raises,
    `decode` gives ''.

    Args:
        vocab_size: the model's vocabulary size.
        eos_token_id: id that ends a sequence (None: none).
    """

    token_ids_only = True
    bos_token_id = None
    pad_token_id = None

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        raise ValueError("this model has no tokenizer (token ids only): give token ids, not text")

    def decode(self, ids) -> str:
        return ""


def load_tokenizer(directory=None, config=None):
    """The tokenizer of a checkpoint directory: its `tokenizer.json` if it has one, else the
    built-in `ByteTokenizer` (also for `directory=None`).

    Args:
        directory: a checkpoint directory, or None.
        config: anything with `vocab_size`, which the byte tokenizer must fit (259 to 384 ids).

    Raises:
        ValueError: `tokenizer.json` cannot be read, or the byte tokenizer does not fit the model.
    """
    if directory is not None and os.path.isfile(os.path.join(os.fspath(directory), TOKENIZER_FILE)):
        return HFTokenizer(directory)
    V = getattr(config, "vocab_size", None)
    most = -(-ByteTokenizer.vocab_size // BYTE_VOCAB_PADDING) * BYTE_VOCAB_PADDING  # 384
    if V is not None and not ByteTokenizer.vocab_size <= V <= most:
        where = f"{os.fspath(directory)!r} has no {TOKENIZER_FILE}" if directory is not None else "no tokenizer given"
        why = ("it would emit ids the byte tokenizer cannot decode" if V > most
               else "the byte tokenizer's ids would not fit it")
        raise ValueError(
            f"the model's vocab_size {V} does not fit the built-in byte tokenizer's "
            f"{ByteTokenizer.vocab_size} ids (a model for it has {ByteTokenizer.vocab_size} to {most}; {why}) "
            f"and {where}: copy the model's {TOKENIZER_FILE} (and {TOKENIZER_CONFIG_FILE}) into the "
            f"checkpoint directory"
            + (", or serve it by token ids with `shram-static serve --token-ids-only`" if V > most else ""))
    return ByteTokenizer(V)
