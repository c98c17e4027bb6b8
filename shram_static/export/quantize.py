"""Weight quantization of the exported `.pte` step: torchao on every nn.Linear of a model copy
(projections, lm_head, the `FusedExperts`), applied before `torch.export`; optionally the
embedding table as int8 rows (`Int8Embedding`)."""

import copy

import torch
from torch import nn

from ..backends import quantize_modes
from ..fast_layers import FusedExperts, fuse_experts_

QUANTIZE_MODES = (None, *quantize_modes("pte"))  # float, then the `pte-*` backends' modes
GROUP = 32  # int4 group size: XNNPACK's blockwise int4 GEMM takes multiples of 32


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with per-row scales; looks up like nn.Embedding.

    WHY not torchao's weight-only config: neither its `dequantize_affine` nor
    `quantized_decomposed::embedding_byte` is in the pip ExecuTorch runtime; a gather, a cast
    and a multiply are.

    Args:
        emb: the nn.Embedding whose weight it quantizes (not kept).
    """

    def __init__(self, emb: nn.Embedding):
        from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

        super().__init__()
        w, block = emb.weight.detach(), (1, emb.weight.shape[-1])  # symmetric int8 per row: w ~= q * scale
        scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, keepdim=True)
        self.register_buffer("weight_q", quantize_affine(w, block, scale, zero, torch.int8))  # (V, d) int8
        self.register_buffer("scale", scale.to(w.dtype))  # (V, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int64 -> (..., d)."""
        rows = ids.reshape(-1)
        x = self.weight_q.index_select(0, rows).to(self.scale.dtype) * self.scale.index_select(0, rows)
        return x.view(*ids.shape, -1)


def quantize_weights(model: nn.Module, mode: str = "int8", embedding: bool = False) -> nn.Module:
    """A copy of `model` with its weights quantized for the exported step (experts fused first).

    "int8" ("8da8w"): every nn.Linear takes dynamic int8 activations and per-channel int8
    weights (executorch's own LLM flow; XNNPACK's QD8 GEMMs; weight-only int8 lowered to a
    program returning NaN). "8da4w": int4 weights in groups of 32 (optimum-executorch's edge
    config), except layers whose input width is no multiple of 32 (XNNPACK delegates only
    those) and the experts (int4 experts flip later layers' routing), which keep int8. A tied
    lm_head gets its own quantized copy of the table.

    Args:
        model: a `ShramForCausalLM` (left untouched).
        mode: "int8" or "8da4w".
        embedding: also store the embedding as int8 rows (`Int8Embedding`): a quarter of its
            bytes; off by default (it moves the first layer's routing input: more logit drift).

    Returns:
        The quantized copy.
    """
    _check_mode(mode)
    return quantize_weights_(fuse_experts_(copy.deepcopy(model).eval()), mode, embedding)


def _check_mode(mode) -> None:
    if mode not in QUANTIZE_MODES[1:]:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {mode!r}")


def quantize_weights_(q: nn.Module, mode: str = "int8", embedding: bool = False) -> nn.Module:
    """`quantize_weights` in place on an `export_copy` (experts fused); returns `q`.

    WHY: copying the export copy again would hold every float weight a third time.
    """
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, quantize_

    _check_mode(mode)
    if not all(isinstance(m.bea, FusedExperts) for m in q.modules() if hasattr(m, "bea")):
        raise ValueError("quantize_weights_ takes a model with fused experts (export_copy); "
                         "use quantize_weights on any other")
    if q.lm_head is None:  # tied: the head gets its own nn.Linear, quantized below
        q.lm_head = nn.Linear(q.config.embedding_width, q.config.vocab_size, bias=False, device="meta")
        q.lm_head.weight = nn.Parameter(q.embed_tokens.weight.detach().clone(), requires_grad=False)
    if embedding:
        q.embed_tokens = Int8Embedding(q.embed_tokens)
    # Projections and logits are nn.Linear: a torchao weight has no `aten.t` (`x @ W.t()` fails).
    plain = lambda m, fqn: isinstance(m, nn.Linear) and type(m.weight) is nn.Parameter  # noqa: E731
    experts = {id(lin) for m in q.modules() if isinstance(m, FusedExperts) for lin in (m.qkv, m.o)}
    if mode == "8da4w":
        quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP)),
                  filter_fn=lambda m, fqn: plain(m, fqn) and m.in_features % GROUP == 0 and id(m) not in experts)
    quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              filter_fn=plain)
    return q
