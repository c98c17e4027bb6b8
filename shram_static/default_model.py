"""The built-in model: a small byte-level SHRAM trained on Shakespeare, shipped as package data.

`shram_static/builtin/` holds its checkpoint (bf16 weights, loaded as fp32), `train_log.json`
and `loss.png`, made by `shram-static train` and copied there by `train.write_builtin`.
"""

import os

from .config import ShramConfig
from .model import ShramForCausalLM
from .tokenizer import TokenIdsOnly, load_tokenizer

BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")


def default_config() -> ShramConfig:
    """The built-in model's config (byte vocabulary, d=160, 4 layers, context 1024)."""
    return ShramConfig.from_json_file(os.path.join(BUILTIN_DIR, "config.json"))


def default_model() -> ShramForCausalLM:
    """The built-in model (fp32, eval mode), identical on every call and machine.

    Raises:
        FileNotFoundError: the package data is missing (a broken install).
    """
    return ShramForCausalLM.from_pretrained(BUILTIN_DIR)


def load_model_and_tokenizer(checkpoint: str | None = None, token_ids_only: bool = False):
    """(model, tokenizer) of a checkpoint directory (`load_tokenizer`), or of the built-in model.

    Args:
        checkpoint: a checkpoint directory, or None for the built-in model and byte tokenizer.
        token_ids_only: no tokenizer at all (`TokenIdsOnly`): a model served by token ids.

    Raises:
        FileNotFoundError, CheckpointError, ValueError: a directory that cannot be loaded, or
        whose tokenizer does not cover the model's vocabulary.
    """
    model = default_model() if checkpoint is None else ShramForCausalLM.from_pretrained(checkpoint)
    if token_ids_only:
        return model, TokenIdsOnly(model.config.vocab_size, getattr(model.config, "eos_token_id", None))
    return model, load_tokenizer(checkpoint, model.config)
