"""SHRAM configuration (docs/design.md, "Config"): fields, defaults, validation and derived sizes."""

import math

from transformers import AutoConfig, PretrainedConfig

ROPE_MODES = ("main_sequence", "semantic_sequence")


class ShramConfig(PretrainedConfig):
    """Configuration of a SHRAM decoder-only language model, as the original code's `config.json`
    (`model_type = "shram"`; unknown keys such as `auto_map` are kept and ignored).

    Args:
        vocab_size, embedding_width, mlp_width, num_decoder_layers: V, width d, SwiGLU width F, depth.
        num_sliding_window_heads: heads H of the local (sliding-window) path.
        num_mosrah_heads: expert heads L of the sparse (MoSRAH) path.
        num_selected_heads: heads K each token selects; `L % K == 0`.
        head_dim: per-head width u of both paths; even.
        window_size: keys a local query sees, itself included.
        rope_mode: sparse-path RoPE at the token position ("main_sequence") or at its index
            in its expert's sequence ("semantic_sequence").
        rms_norm_eps: RMSNorm epsilon.
        local_rope_theta, mosrah_rope_theta: RoPE bases of the two paths.
        training_sequence_length: C_train.
        inference_sequence_length: C_target (default C_train), also the live tokens per row.
        alpha, beta: YaRN ramp bounds.
        attention_dropout: only 0.0 is supported.
        tie_word_embeddings: lm_head shares the embedding matrix.
        use_residual_gate: learnable scalar residual gates (False: fixed 1/sqrt(layers)).

    Raises:
        ValueError: on any invalid field, naming the field and what to change.
    """

    model_type = "shram"

    def __init__(
        self,
        vocab_size: int = 50277,
        embedding_width: int = 512,
        mlp_width: int = 1366,
        num_decoder_layers: int = 12,
        num_sliding_window_heads: int = 16,
        num_mosrah_heads: int = 16,
        num_selected_heads: int = 16,
        head_dim: int = 16,
        window_size: int = 128,
        rope_mode: str = "main_sequence",
        rms_norm_eps: float = 1e-5,
        local_rope_theta: float = 10000.0,
        mosrah_rope_theta: float = 10000.0,
        training_sequence_length: int = 1024,
        inference_sequence_length: int | None = None,
        alpha: float = 1.0,
        beta: float = 32.0,
        attention_dropout: float = 0.0,
        tie_word_embeddings: bool = False,
        use_residual_gate: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.embedding_width = embedding_width
        self.mlp_width = mlp_width
        self.num_decoder_layers = num_decoder_layers
        self.num_sliding_window_heads = num_sliding_window_heads
        self.num_mosrah_heads = num_mosrah_heads
        self.num_selected_heads = num_selected_heads
        self.head_dim = head_dim
        self.window_size = window_size
        self.rope_mode = rope_mode
        self.rms_norm_eps = rms_norm_eps
        self.local_rope_theta = local_rope_theta
        self.mosrah_rope_theta = mosrah_rope_theta
        self.training_sequence_length = training_sequence_length
        self.inference_sequence_length = (training_sequence_length if inference_sequence_length is None
                                          else inference_sequence_length)
        self.alpha = alpha
        self.beta = beta
        self.attention_dropout = attention_dropout
        self.use_residual_gate = use_residual_gate
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "embedding_width", "mlp_width", "num_decoder_layers",
                     "num_sliding_window_heads", "num_mosrah_heads", "num_selected_heads", "head_dim",
                     "window_size", "training_sequence_length", "inference_sequence_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ShramConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"ShramConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.rope_mode not in ROPE_MODES:
            raise ValueError(f"ShramConfig.rope_mode must be one of {ROPE_MODES}, got {self.rope_mode!r}")
        if self.num_mosrah_heads % self.num_selected_heads:
            raise ValueError(
                f"ShramConfig.num_mosrah_heads ({self.num_mosrah_heads}) must be a multiple of "
                f"num_selected_heads ({self.num_selected_heads}) for block-balanced routing")
        if self.attention_dropout != 0.0:
            raise ValueError(f"ShramConfig.attention_dropout must be 0.0 (inference only), got {self.attention_dropout!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ShramConfig.rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not self.beta > self.alpha:
            raise ValueError(f"ShramConfig.beta ({self.beta}) must be greater than alpha ({self.alpha}) for the YaRN ramp")

    @property
    def block_length(self) -> int:
        """W = L // K: tokens per routing block (each expert is used once per full block)."""
        return self.num_mosrah_heads // self.num_selected_heads

    @property
    def scale(self) -> float:
        """s = C_target / C_train, the YaRN context extension factor."""
        return self.inference_sequence_length / self.training_sequence_length

    @property
    def mosrah_cache_length(self) -> int:
        """Most tokens one expert head holds for one row at full capacity."""
        return math.ceil(self.inference_sequence_length * self.num_selected_heads / self.num_mosrah_heads) + self.block_length

    @property
    def mosrah_packed_length(self) -> int:
        """Training-time per-expert sequence length (YaRN C of semantic_sequence positions)."""
        return math.ceil(self.training_sequence_length * self.num_selected_heads / self.num_mosrah_heads) + self.block_length


# `AutoConfig.from_pretrained(dir)` reads a SHRAM config.json (the original code's too) as a
# `ShramConfig`, without trust_remote_code. exist_ok: re-importing is fine.
AutoConfig.register(ShramConfig.model_type, ShramConfig, exist_ok=True)
