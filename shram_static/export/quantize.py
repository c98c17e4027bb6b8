"""Weight quantization of the exported step (ExecuTorch, XNNPACK): source transforms applied to a
copy of the model before `torch.export`.

The nn.Linear layers are quantized by torchao: every projection, the lm_head, and the sparse
path's experts in the exported layout (`FusedExperts`: every expert as one linear each way).
Optionally the embedding table as int8 rows with one scale per row (`Int8Embedding`).
"""

import copy

import torch
from torch import nn

from ..backends import quantize_modes
from ..fast_layers import FusedExperts, fuse_experts_

QUANTIZE_MODES = (None, *quantize_modes("pte"))  # float, then the `pte-*` backends' modes
GROUP = 32  # int4 group size: XNNPACK's blockwise int4 GEMM takes multiples of 32


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per row (last dim): w (..., b) -> q (..., b)
    int8 and scale (..., 1) in w's dtype, w ~= q * scale. torchao's primitives, the ones its
    per-axis int8 linear weights use."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    block = (1,) * (w.dim() - 1) + (w.shape[-1],)
    scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, keepdim=True)
    return quantize_affine(w, block, scale, zero, torch.int8), scale.to(w.dtype)


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with per-row scales; looks up like nn.Embedding.

    WHY not torchao's weight-only config: its `dequantize_affine` has no out variant in the pip
    ExecuTorch runtime, and the 8-bit embedding kernel ExecuTorch's llama export rewrites it to
    (`quantized_decomposed::embedding_byte`) is not in that runtime either. A row gather of the
    int8 table, a cast and a multiply are kernels it has (`index_select`, `_to_copy`, `mul`).

    Args:
        emb: the nn.Embedding whose weight it quantizes (not kept).
    """

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        q, s = int8_rows(emb.weight.detach())
        self.register_buffer("weight_q", q)  # (V, d) int8
        self.register_buffer("scale", s)  # (V, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int64 -> (..., d)."""
        rows = ids.reshape(-1)
        x = self.weight_q.index_select(0, rows).to(self.scale.dtype) * self.scale.index_select(0, rows)
        return x.view(*ids.shape, -1)


def quantize_weights(model: nn.Module, mode: str = "int8", embedding: bool = False) -> nn.Module:
    """Returns a copy of `model` whose weights are quantized for the exported step (its experts
    in the exported layout).

    Modes:
      * "int8" ("8da8w"): every nn.Linear (lm_head included) takes dynamically quantized int8
        activations and int8 weights, one scale per output channel. WHY this config: it is
        the flow executorch 1.4.1's own LLM export uses, and XNNPACK lowers it to QD8 GEMMs
        (about a third of the file size, several times faster linears). Weight-only int8 (`IntxWeightOnlyConfig`)
        lowered to a program that returned NaN with fp32-sized weights.
      * "8da4w": as "int8" but int4 linear weights with one scale per group of 32 inputs (what
        optimum-executorch ships for edge LLMs on XNNPACK); a layer whose input width is not a
        multiple of 32 (e.g. the bench config's 1366-wide down_proj) keeps int8 weights,
        because XNNPACK delegates only group sizes that are multiples of 32. The experts keep
        int8 weights too: int4 experts perturb the sparse path's output enough to flip later
        layers' routing (on random-weight models far more argmax flips against fp32 than with
        int8 experts), for a small saving of bytes.
    A tied lm_head gets its own quantized copy of the table (int8 rows cannot feed XNNPACK's
    linear kernel, and a float head would be the largest weight a quantized step reads).

    The experts are fused first (`fuse_experts_`, as the export copy is), so their two linears
    are quantized like the others. (Gathering int8 expert rows per token instead is slower:
    the rows are widened to float by a portable `_to_dim_order_copy`; docs/performance.md, "Tried and not kept".)

    Args:
        model: a `ShramForCausalLM` (left untouched).
        mode: "int8" or "8da4w".
        embedding: also store the embedding as int8 rows (`Int8Embedding`): a quarter of the
            table's bytes at no measured step cost (docs/performance.md, "Quantization").
            Off by default (as in ExecuTorch's and optimum-executorch's LLM exports, where
            embedding quantization is its own option): it moves the first layer's routing
            input, and on the random-weight golden models that flips expert choices, adding
            far more logit drift than the linears (bounded by tests/test_quant_drift.py).

    Returns:
        The quantized copy.
    """
    _check_mode(mode)
    # the experts as the exported step reads them
    return quantize_weights_(fuse_experts_(copy.deepcopy(model).eval()), mode, embedding)


def _check_mode(mode) -> None:
    if mode not in QUANTIZE_MODES[1:]:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {mode!r}")


def quantize_weights_(q: nn.Module, mode: str = "int8", embedding: bool = False) -> nn.Module:
    """`quantize_weights` in place, on a copy that owns its weights with its experts fused (an
    `export_copy`); returns `q`.

    WHY: `lower_program` quantizes its own export copy; copying it again held every float weight
    a third time while quantizing (the caller's, the export copy's, this copy's).
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
    # The model computes every projection and the logits with nn.Linear, which a torchao
    # quantized weight implements (it has no `aten.t`: `x @ W.t()` would fail here).
    plain = lambda m, fqn: isinstance(m, nn.Linear) and type(m.weight) is nn.Parameter  # noqa: E731
    experts = {id(lin) for m in q.modules() if isinstance(m, FusedExperts) for lin in (m.qkv, m.o)}
    if mode == "8da4w":
        quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP)),
                  filter_fn=lambda m, fqn: plain(m, fqn) and m.in_features % GROUP == 0 and id(m) not in experts)
    quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              filter_fn=plain)
    return q
