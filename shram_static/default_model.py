"""The built-in model: a small byte-level SHRAM trained on Shakespeare, shipped as package data.

`shram_static/builtin/` holds its checkpoint (`config.json` + `model.safetensors`, bf16
weights, loaded as fp32), the record of the training run (`train_log.json`) and its loss curve
(`loss.png`). It was made by `shram-static train` (see the README, "Training and evaluation")
and copied here with `shram_static.train.write_builtin`.
"""

import os

from .config import ShramConfig
from .model import ShramForCausalLM
from .tokenizer import ByteTokenizer, TokenIdsOnly, load_tokenizer

BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")


def default_config() -> ShramConfig:
    """The built-in model's config: byte vocabulary (259), d=160, 4 layers, 4 local heads,
    4 expert heads of which each token selects 2, window 32, trained on 256-byte windows,
    context 1024 (YaRN-extended sparse path)."""
    return ShramConfig.from_json_file(os.path.join(BUILTIN_DIR, "config.json"))


def default_model() -> ShramForCausalLM:
    """The built-in model (fp32, eval mode), identical on every call and machine.

    Raises:
        FileNotFoundError: the package data is missing (a broken install).
    """
    return ShramForCausalLM.from_pretrained(BUILTIN_DIR)


def load_model_and_tokenizer(checkpoint: str | None = None, token_ids_only: bool = False):
    """(model, tokenizer) for a checkpoint directory, or the built-in model and the byte
    tokenizer when `checkpoint` is None.

    A checkpoint directory with a `tokenizer.json` uses it; otherwise the byte tokenizer, which
    must cover the model's vocabulary (259 tokens).

    Args:
        checkpoint: a checkpoint directory, or None for the built-in model.
        token_ids_only: no tokenizer at all (`TokenIdsOnly`): a model served by token ids.

    Raises:
        FileNotFoundError, CheckpointError (a ValueError), ValueError: a directory that cannot
        be loaded, or whose tokenizer does not cover the model's vocabulary.
    """
    model = default_model() if checkpoint is None else ShramForCausalLM.from_pretrained(checkpoint)
    if token_ids_only:
        return model, TokenIdsOnly(model.config.vocab_size, getattr(model.config, "eos_token_id", None))
    if checkpoint is None:
        return model, ByteTokenizer()
    return model, load_tokenizer(checkpoint, model.config)
