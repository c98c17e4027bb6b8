"""`ShramForCausalLM`: SHRAM weights and the uncached full forward (docs/design.md, "What SHRAM computes")."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .console import quiet_loggers

# WHY quiet: transformers' model classes import torchao, whose CUDA-library and deprecated-Enum
# warnings concern nothing this package uses (only those two loggers' records are dropped).
with quiet_loggers("torchao", "torch.utils._pytree"):
    from transformers import AutoModelForCausalLM, PreTrainedModel
    from transformers.utils import ModelOutput

from .attention import attention_bias, masked_attention
from .cache import ShramCache
from .config import ShramConfig
from .generation import ShramGenerationMixin, default_compile_config
from .layers import DecoderLayer, RMSNorm
from .rope import RotaryTables, apply_rope
from .validation import check_capacity, check_input_ids, check_mask


@dataclass
class CausalLMOutput(ModelOutput):
    """logits (B, N, V); selected_heads (layers, B, N, K), -1 at dead tokens (`output_routing`);
    cache, the `ShramCache` a cached forward advanced."""

    logits: torch.Tensor | None = None
    selected_heads: torch.Tensor | None = None
    cache: ShramCache | None = None


class ShramModel(nn.Module):
    def __init__(self, config: ShramConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_decoder_layers))
        self.norm = RMSNorm(config.embedding_width, config.rms_norm_eps)


class ShramForCausalLM(PreTrainedModel, ShramGenerationMixin):
    """SHRAM decoder-only language model with the original code's checkpoint layout; `generate()`
    runs on a `ShramCache` (`generation.py`), checkpoint I/O is `checkpoint.py`'s.

    Args:
        config: the model's `ShramConfig` (weights initialised as the original does).
    """

    config_class = ShramConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: ShramConfig):
        super().__init__(config)
        self.generation_config.compile_config = default_compile_config()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embedding_width)
        self.model = ShramModel(config)
        self.rope = RotaryTables(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.embedding_width, config.vocab_size, bias=False))
        self._init_parameters()
        self.eval()

    # Not `_init_weights`: PreTrainedModel calls that name with a module argument.
    def _init_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("norm.weight", "residual_scale")):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std)

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, d) lm_head matrix (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: (..., d) -> (..., V)."""
        h = self.model.norm(x)
        if self.lm_head is not None:
            return self.lm_head(h)
        # F.linear, not `x @ W.t()`: XNNPACK delegates linear, not a transposed mm, and torchao's
        # int8 flow quantizes only linear
        return F.linear(h, self.embed_tokens.weight)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str = torch.float32, *, config: ShramConfig | None = None,
                        **kwargs) -> "ShramForCausalLM":
        """Loads a checkpoint directory (`config.json` + `model.safetensors`) in eval mode; also the
        target of `AutoModelForCausalLM.from_pretrained(path)`.

        Args:
            path: directory written by the original SHRAM code or by `save_pretrained`.
            dtype: parameter dtype after loading; "auto" keeps the file's. Alias `torch_dtype=`.
            config: a `ShramConfig` to use instead of the directory's `config.json`.
            **kwargs: the Auto classes' options (`trust_remote_code`, `revision`, ...; ignored),
                `subfolder`, `check_finite` (default True: a NaN or Inf is a CheckpointError).

        Returns:
            The model.

        Raises:
            CheckpointError naming any bad key; TypeError for an unknown keyword.
        """
        from .checkpoint import load_pretrained
        return load_pretrained(cls, path, dtype, config=config, **kwargs)

    def save_pretrained(self, path) -> None:
        """Writes `config.json` and `model.safetensors` (tied embeddings stored once)."""
        from .checkpoint import save_pretrained
        save_pretrained(self, path)

    # WHY: PreTrainedModel precedes the mixin in the bases and defines its own.
    get_compiled_call = ShramGenerationMixin.get_compiled_call

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_routing: bool = False, cache: ShramCache | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None,
                logits_to_keep: int = 0) -> CausalLMOutput:
        """Full uncached forward over a batch of token streams, or the next columns of a cache.

        Args:
            input_ids: (B, N) token ids.
            attention_mask: (B, N) 1 for live tokens, 0 for dead ones (no-ops); default all live.
                With a cache it covers the N new columns only.
            output_routing: also return the selected experts per layer (uncached only).
            cache: a `ShramCache` to append the N columns to; None: the uncached forward.
            use_cache, return_dict: accepted for transformers' generate(); ignored.
            logits_to_keep: 0 keeps every column's logits; k > 0 only the last k columns'.

        Returns:
            CausalLMOutput with logits (B, N or k, V) (unspecified at dead positions), the cache
            when one was given and, when asked, selected_heads (layers, B, N, K), -1 at dead ones.

        Raises:
            TypeError, ValueError, CapacityError (a row would pass the capacity), before anything runs.
        """
        if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool):
            raise TypeError(f"logits_to_keep must be an int >= 0 (0: every column), got {logits_to_keep!r}")
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0: every column), got {logits_to_keep!r}")
        if cache is not None:
            return self._cached_forward(input_ids, attention_mask, output_routing, cache, logits_to_keep)
        self._check_input(input_ids)
        live = check_mask(attention_mask, input_ids.shape)
        live = torch.ones_like(input_ids, dtype=torch.bool) if live is None else live.to(input_ids.device)
        return self._forward(input_ids.long(), live, output_routing, logits_to_keep)

    def _check_input(self, input_ids) -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a (batch, length) torch.Tensor of token ids, got "
                            f"{type(input_ids).__name__}; wrap it with torch.tensor(...)")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}"
                             + ("; add a batch dimension with input_ids[None]" if input_ids.dim() == 1 else ""))
        check_input_ids(input_ids, self.config.vocab_size)

    def _cached_forward(self, input_ids, attention_mask, output_routing, cache, keep) -> CausalLMOutput:
        if not torch.compiler.is_compiling():
            # eager only: compiled, the checks would read values back (a graph break); generate()
            # feeds its own tokens and checked the capacity up front
            self._check_cache_call(input_ids, attention_mask, output_routing, cache)
        if attention_mask is None:
            live = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        else:
            live = attention_mask.to(torch.bool)
        with torch.no_grad():  # the state is written in place: keep it out of any autograd graph
            logits = cache.run(self, input_ids.long(), live, keep)
        return CausalLMOutput(logits=logits, cache=cache)

    def _check_cache_call(self, input_ids, attention_mask, output_routing, cache) -> None:
        if not isinstance(cache, ShramCache):
            raise TypeError(f"cache must be a shram_static.ShramCache, got {type(cache).__name__}")
        if output_routing:
            raise ValueError("output_routing is only available from the uncached forward (cache=None)")
        self._check_input(input_ids)
        if input_ids.shape[0] != cache.batch_size or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape ({cache.batch_size}, N >= 1) for this cache, got "
                             f"{tuple(input_ids.shape)}")
        live = check_mask(attention_mask, input_ids.shape)
        n_new = input_ids.shape[1] if live is None else live.long().sum(1).to(cache.device)
        check_capacity(cache.live_counts + n_new, cache.capacity,
                       advice="build the cache for a model with a larger inference_sequence_length")

    def _forward(self, ids: torch.Tensor, live: torch.Tensor, output_routing: bool, keep: int = 0) -> CausalLMOutput:
        cfg = self.config
        B, N = ids.shape
        pos = (live.long().cumsum(1) - 1).clamp(min=0)  # (B, N) position of each live token
        x = self.embed_tokens(ids)  # (B, N, d)
        start = torch.zeros(B, dtype=torch.long, device=ids.device)
        taken = torch.zeros(B, cfg.num_mosrah_heads, dtype=torch.bool, device=ids.device)
        # Local visibility: live key j with pos_t - window < pos_j <= pos_t (causal in raw order).
        tri = torch.ones(N, N, dtype=torch.bool, device=ids.device).tril()
        dp = pos[:, :, None] - pos[:, None, :]  # (B, N, N)
        local_mask = tri & live[:, None, :] & (dp < cfg.window_size) & (dp >= 0)
        local_bias = attention_bias(local_mask[:, None], x.dtype)  # (B, 1, N, N)
        local_seen = local_mask[:, None].any(-1, keepdim=True).to(x.dtype)  # (B, 1, N, 1)
        cos_l, sin_l = (t[:, None] for t in self.rope.local(pos))  # (B, 1, N, u)
        routing = []
        for layer in self.model.layers:
            h = layer.attn_norm(x)
            la, sa = layer.attention.local_attention, layer.attention.sparse_attention
            q, k, v = la.qkv(h)  # (B, H, N, u)
            q, k = apply_rope(q, cos_l, sin_l), apply_rope(k, cos_l, sin_l)
            y = la.out(masked_attention(q, k, v, local_bias, 1 / math.sqrt(cfg.head_dim), local_seen))
            idx, P = sa.router(h, live, start, taken, cfg.num_selected_heads)
            routing.append(torch.where(live[..., None], idx, -1))
            x = layer.residual(x, y + self._mosrah_dense(sa.bea, h, live, pos, idx, P, tri))
        return CausalLMOutput(logits=self.logits(x[:, -keep:] if keep else x),
                              selected_heads=torch.stack(routing) if output_routing else None)

    def _mosrah_dense(self, bea, h, live, pos, idx, P, tri) -> torch.Tensor:
        """Sparse path over a whole sequence: every expert computed, masked by selection."""
        cfg = self.config
        L = cfg.num_mosrah_heads
        sel = (idx[..., None] == torch.arange(L, device=h.device)).any(-2) & live[..., None]  # (B, N, L)
        w = (sel.to(h.dtype) * 0).scatter_add(-1, idx, P * live[..., None].to(P.dtype))  # (B, N, L)
        q, k, v = bea.project_all(h)  # (B, L, N, u)
        selT = sel.transpose(1, 2)  # (B, L, N)
        if cfg.rope_mode == "main_sequence":
            r = pos[:, None, :].expand_as(selT)
        else:
            r = (selT.long().cumsum(-1) - 1).clamp(min=0)  # index of the token in S_l
        cos, sin = self.rope.sparse(r)  # (B, L, N, u)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = tri & selT[..., :, None] & selT[..., None, :]  # (B, L, N, N)
        seen = mask.any(-1, keepdim=True).to(q.dtype)
        scale = self.rope.sparse_factor / math.sqrt(cfg.head_dim)
        y = masked_attention(q, k, v, attention_bias(mask, q.dtype), scale, seen)
        return bea.output_all(y, w)


# `AutoModelForCausalLM.from_pretrained(dir)` loads a SHRAM checkpoint (the original code's too)
# into this package, without trust_remote_code. exist_ok: re-importing is fine.
AutoModelForCausalLM.register(ShramConfig, ShramForCausalLM, exist_ok=True)
