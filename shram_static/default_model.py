"""The built-in model: a small SHRAM config with deterministic seeded weights, so every command
works with no checkpoint. Its weights are random (not trained): its text is gibberish, but it
exercises every part of the network (no zero gate hides a sublayer)."""

import math

import torch

from .config import ShramConfig
from .model import ShramForCausalLM
from .tokenizer import ByteTokenizer, load_tokenizer

DEFAULT_SEED = 20240601


def default_config() -> ShramConfig:
    """The built-in model's config: byte vocabulary (259), d=64, 2 layers, 4 local heads,
    8 expert heads of which each token selects 2, window 16, context 256."""
    return ShramConfig(vocab_size=259, embedding_width=64, mlp_width=192, num_decoder_layers=2,
                       num_sliding_window_heads=4, num_mosrah_heads=8, num_selected_heads=2,
                       head_dim=16, window_size=16, training_sequence_length=256)


@torch.no_grad()
def seeded_weights_(model: ShramForCausalLM, seed: int = DEFAULT_SEED) -> ShramForCausalLM:
    """Fills every parameter (and residual-scale buffer) from a local generator.

    Projections get normal(0, 1/sqrt(fan_in)), the embedding normal(0, 1), norms 1 + 0.1 * normal,
    residual gates uniform(0.5, 1.5). The global RNG is never touched.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("residual_scale"))
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("residual_scale"):
            v = torch.rand(t.shape, generator=gen) + 0.5
        elif name.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif name == "embed_tokens.weight":
            v = torch.randn(t.shape, generator=gen)
        else:
            # (out, in) for nn.Linear weights; (L, d, u) / (L, u, d) expert matrices read from dim -2.
            fan_in = t.shape[-1] if t.dim() == 2 else t.shape[-2]
            v = torch.randn(t.shape, generator=gen) / math.sqrt(fan_in)
        t.copy_(v.to(t.dtype))
    return model


def default_model() -> ShramForCausalLM:
    """The built-in model (fp32, eval mode), identical on every call and machine."""
    # The constructor's own init draws from the global RNG: fork it so callers' state is kept.
    with torch.random.fork_rng(devices=[]):
        model = ShramForCausalLM(default_config())
    return seeded_weights_(model).eval()


def load_model_and_tokenizer(checkpoint: str | None = None):
    """(model, tokenizer) for a checkpoint directory, or the built-in model and the byte
    tokenizer when `checkpoint` is None.

    A checkpoint directory with a `tokenizer.json` uses it; otherwise the byte tokenizer, which
    needs a vocabulary of at least 259 tokens.

    Raises:
        FileNotFoundError, CheckpointError (a ValueError), ValueError: a directory that cannot
        be loaded, or whose tokenizer does not fit the model's vocabulary.
    """
    if checkpoint is None:
        return default_model(), ByteTokenizer()
    model = ShramForCausalLM.from_pretrained(checkpoint)
    tok = load_tokenizer(checkpoint)
    if isinstance(tok, ByteTokenizer) and model.config.vocab_size < tok.vocab_size:
        raise ValueError(f"checkpoint {checkpoint!r} has no tokenizer.json and its vocab_size "
                         f"{model.config.vocab_size} is smaller than the built-in byte tokenizer's "
                         f"{tok.vocab_size}; add the checkpoint's tokenizer.json to the directory")
    return model, tok
