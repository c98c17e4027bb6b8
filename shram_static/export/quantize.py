"""Weight quantization of the exported step (ExecuTorch, XNNPACK): torchao source transforms
applied to a copy of the model before `torch.export`."""

import copy

import torch
from torch import nn

QUANTIZE_MODES = (None, "int8", "8da4w")
GROUP = 32  # int4 group size: XNNPACK's blockwise int4 GEMM takes multiples of 32


def quantize_linears(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Returns a copy of `model` whose nn.Linear layers (lm_head included) take dynamically
    quantized int8 activations and quantized weights.

    Modes:
      * "int8" ("8da8w"): int8 weights, one scale per output channel. WHY this config: it is
        the flow executorch 1.4.1's own LLM export uses, and XNNPACK lowers it to QD8 GEMMs
        (probe: 0.37x file size, 5x faster linears). Weight-only int8 (`IntxWeightOnlyConfig`)
        lowered to a program that returned NaN with fp32-sized weights.
      * "8da4w": int4 weights with one scale per group of 32 inputs (what optimum-executorch
        ships for edge LLMs on XNNPACK); a layer whose input width is not a multiple of 32
        (e.g. the bench config's 1366-wide down_proj) keeps "int8" weights, because XNNPACK
        delegates only group sizes that are multiples of 32.
    Not quantized: the embedding (8-bit embeddings need `quantized_decomposed::embedding_byte`,
    which the pip runtime lacks) and the sparse path's per-expert matrices (L, d, u), which are
    gathered per token, not nn.Linear (a decode step reads only K of the L experts: 1/4 of 2 MB
    per layer in the bench config, against 19 MB of nn.Linear weights).

    Args:
        model: a `ShramForCausalLM` (left untouched).
        mode: "int8" or "8da4w".

    Returns:
        The quantized copy.
    """
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, quantize_

    if mode not in QUANTIZE_MODES[1:]:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {mode!r}")
    q = copy.deepcopy(model).eval()
    # The model computes every projection and the logits with nn.Linear / F.linear, which a
    # torchao quantized weight implements (it has no `aten.t`: `x @ W.t()` would fail here).
    plain = lambda m, fqn: isinstance(m, nn.Linear) and type(m.weight) is nn.Parameter  # noqa: E731
    if mode == "8da4w":
        quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP)),
                  filter_fn=lambda m, fqn: plain(m, fqn) and m.in_features % GROUP == 0)
    quantize_(q, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              filter_fn=plain)
    return q
