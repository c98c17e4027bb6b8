"""Weight-only int8 and int4 quantization of the exported ONNX graphs with onnxruntime's
`MatMulNBitsQuantizer` (block-wise, symmetric): every `MatMul` with a constant weight becomes a
`com.microsoft.MatMulNBits`; with `embedding=True` (int4) the token embedding's `Gather` becomes
a `GatherBlockQuantized` of int4 rows (for download-bound sites).
"""

import logging

from ..backends import quantize_modes
from ..console import quiet_loggers

ONNX_QUANTIZE_MODES = quantize_modes("onnx")  # the `onnx-*` backends' modes
BLOCK = 32  # inputs per scale: q4_0's and q8_0's block (accuracy against MatMulNBits' default of 128)
# WHY accuracy_level 4: int8 activations per block and int8 dot products (MLAS with VNNI); the
# default level's fp32-compute 8-bit path is far slower than the fp32 graph itself.
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
        embedding: also the token embedding (the `Gather` of `input_ids`), as int4 rows; int4
            only (onnxruntime writes 4-bit `GatherBlockQuantized` only).

    Returns:
        (the quantized ModelProto, how many MatMuls became MatMulNBits).

    Raises:
        ValueError: a bad mode, or `embedding` with int8.
    """
    MatMulNBitsQuantizer = _quantizer_class()
    check_onnx_quantize(mode)
    if embedding and mode != "int4":
        raise ValueError(f"the embedding is quantized with int4 only (GatherBlockQuantized), got quantize={mode!r}")
    before = sum(n.op_type == "MatMul" for n in model.graph.node)
    ops, exclude = ("MatMul",), []
    if embedding:
        ops = ("MatMul", "Gather")
        # only the token embedding: another constant Gather (a position table) keeps its floats
        exclude = [n.name for n in model.graph.node if n.op_type == "Gather" and n.input[1] != "input_ids"]
    # WHY quiet: it logs a line per MatMul at INFO, and warns that int4 data lifts the opset to 21 (validly)
    with quiet_loggers("onnxruntime.quantization"):
        q = MatMulNBitsQuantizer(model, bits=8 if mode == "int8" else 4, block_size=BLOCK, is_symmetric=True,
                                 accuracy_level=ACCURACY_LEVEL, op_types_to_quantize=ops, nodes_to_exclude=exclude)
        q.process()
    out = q.model.model
    return out, before - sum(n.op_type == "MatMul" for n in out.graph.node)


def _quantizer_class():
    """onnxruntime's `MatMulNBitsQuantizer`, imported with the root logger left as it was (WHY: its
    module calls `logging.basicConfig(level=INFO)`: every library's INFO records would print)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return MatMulNBitsQuantizer


def dequantized_matmuls(model):
    """Rewrites each `MatMulNBits` of `model` (an onnx.ModelProto, edited in place) as
    `DequantizeLinear` of the same packed bytes read as [N, K] 4- or 8-bit integers (zero point
    8 or 128, MatMulNBits' symmetric default), `Transpose`, `MatMul`; the packed weights stay
    where they are. WHY: onnxruntime-web's WASM runs MatMulNBits slower than float MatMul, and
    folds constant DequantizeLinears at load with `session.disable_quant_qdq` (docs/web.md).

    Returns:
        (model, how many MatMulNBits were rewritten).
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    nodes, n_done = [], 0
    for n in g.node:
        if n.op_type != "MatMulNBits":
            nodes.append(n)
            continue
        if len(n.input) > 3 and any(n.input[3:]):
            raise ValueError(f"{n.name}: MatMulNBits with zero points, g_idx or bias is not rewritten")
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        K, N, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
        packed, scales = inits[n.input[1]], inits[n.input[2]]
        blocks = -(-K // block)
        kp = blocks * block
        q = TensorProto()
        q.CopyFrom(packed)  # the same bytes (raw or external), read as [N, K padded] integers
        q.name = f"{packed.name}.as_{bits}bit"
        q.data_type = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
        q.dims[:] = [N, kp]
        s = TensorProto()
        s.CopyFrom(scales)
        s.name = f"{scales.name}.as_blocks"
        s.dims[:] = [N, blocks]
        zp_vals = np.full(N * blocks, 8 if bits == 4 else 128, np.uint8)
        zp_raw = _pack_uint4(zp_vals) if bits == 4 else zp_vals.tobytes()
        zp = helper.make_tensor(f"{packed.name}.zero", q.data_type, [N, blocks], zp_raw, raw=True)
        g.initializer.extend([q, s, zp])
        w_t = f"{n.output[0]}.weight_t"
        nodes.append(helper.make_node("DequantizeLinear", [q.name, s.name, zp.name], [w_t], axis=1, block_size=block,
                                      name=f"{n.name}.dequantize"))
        if kp != K:
            cut = f"{n.output[0]}.weight_t_cut"
            for name, v in (("starts", 0), ("ends", K), ("axes", 1)):
                g.initializer.append(numpy_helper.from_array(np.array([v], np.int64), f"{cut}.{name}"))
            nodes.append(helper.make_node("Slice", [w_t, f"{cut}.starts", f"{cut}.ends", f"{cut}.axes"], [cut],
                                          name=f"{n.name}.cut"))
            w_t = cut
        w = f"{n.output[0]}.weight"
        nodes.append(helper.make_node("Transpose", [w_t], [w], perm=[1, 0], name=f"{n.name}.transpose"))
        nodes.append(helper.make_node("MatMul", [n.input[0], w], [n.output[0]], name=f"{n.name}.matmul"))
        n_done += 1
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input}
    kept = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    return model, n_done


def _pack_uint4(values) -> bytes:
    """uint8 values < 16 packed two a byte, the first in the low nibble (ONNX's int4 layout)."""
    import numpy as np

    v = np.asarray(values, np.uint8)
    if len(v) % 2:
        v = np.append(v, np.uint8(0))
    return (v[0::2] | (v[1::2] << 4)).astype(np.uint8).tobytes()
