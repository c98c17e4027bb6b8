"""Weight-only int8 and int4 quantization of the exported ONNX graphs: onnxruntime's own
`MatMulNBitsQuantizer` (block-wise, symmetric), applied to each graph before its weights are
written out.

Every `MatMul` whose weight is a constant becomes a `com.microsoft.MatMulNBits`: every
projection, the MLP, the lm_head, the router and the fused experts (`FusedExperts`: every
expert as one linear each way); the rest multiply two activations. The embedding table stays
float (a step reads one row of it) unless `embedding=True` with int4: then the `Gather` of
`input_ids` from it becomes a `com.microsoft.GatherBlockQuantized` of int4 rows in blocks of 32
(what a download-bound site wants: the bench model's table is a quarter of its weights).
"""

import logging

ONNX_QUANTIZE_MODES = ("int8", "int4")
BLOCK = 32  # inputs per scale: q4_0's and q8_0's block (accuracy against MatMulNBits' default of 128)
# WHY accuracy_level 4: MatMulNBits then quantizes each activation row to int8 per block and
# runs int8 dot products (MLAS' SQNBitGemm with VNNI); at the default level (fp32 compute) its
# 8-bit path ran 12.8x the fp32 graph's time on the bench model (TOOLCHAIN_NOTES.md).
ACCURACY_LEVEL = 4


def check_onnx_quantize(mode) -> None:
    """Raises ValueError unless `mode` is None or one of ONNX_QUANTIZE_MODES."""
    if mode is not None and mode not in ONNX_QUANTIZE_MODES:
        raise ValueError(f"quantize must be None or one of {ONNX_QUANTIZE_MODES} for ONNX, got {mode!r}")


def quantize_graph(model, mode: str, embedding: bool = False):
    """Quantizes the constant weights of `model`'s MatMuls (see the module docstring).

    Args:
        model: an onnx.ModelProto (consumed: the quantizer edits it).
        mode: "int8" or "int4".
        embedding: also the token embedding (`Gather` of the graph input `input_ids` from a
            constant table), as int4 rows; int4 only (onnxruntime's quantizer writes 4-bit
            `GatherBlockQuantized` only).

    Returns:
        (the quantized ModelProto, how many MatMuls became MatMulNBits).

    Raises:
        ValueError: a bad mode, or `embedding` with int8.
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    check_onnx_quantize(mode)
    if embedding and mode != "int4":
        raise ValueError(f"the embedding is quantized with int4 only (GatherBlockQuantized), got quantize={mode!r}")
    before = sum(n.op_type == "MatMul" for n in model.graph.node)
    ops, exclude = ("MatMul",), []
    if embedding:
        ops = ("MatMul", "Gather")
        # only the token embedding: another constant Gather (a position table) keeps its floats
        exclude = [n.name for n in model.graph.node if n.op_type == "Gather" and n.input[1] != "input_ids"]
    log = logging.getLogger("onnxruntime.quantization")  # WHY: it logs a line per MatMul at INFO
    level = log.level
    log.setLevel(logging.ERROR)  # WHY: and warns that int4 data lifts the opset to 21 (it does, validly)
    try:
        q = MatMulNBitsQuantizer(model, bits=8 if mode == "int8" else 4, block_size=BLOCK, is_symmetric=True,
                                 accuracy_level=ACCURACY_LEVEL, op_types_to_quantize=ops, nodes_to_exclude=exclude)
        q.process()
    finally:
        log.setLevel(level)
    out = q.model.model
    return out, before - sum(n.op_type == "MatMul" for n in out.graph.node)
