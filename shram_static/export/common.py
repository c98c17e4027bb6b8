"""What the exporters and the runtime loaders share: format ids, file names, argument checks,
and the model copy every export starts from."""

import copy
import os

import torch
from torch import nn

from ..config import ShramConfig
from ..fast_layers import fuse_experts_
from ..state import prefix_lengths
from ..validation import check_verify_len

PTE_FORMAT = "shram_static.pte/1"
# file_identifier of the ExecuTorch flatbuffer (bytes 4..8 of every .pte written by 1.x).
PTE_MAGIC = b"ET12"
ONNX_FORMAT = "shram_static.onnx/1"
# The input of an exported step that numbers the sparse slots it attends: (P,) float32
# `slot_numbers(T)[:P]`, P a bounded dynamic size (`export_prefix_lengths`).
SLOTS_INPUT = "slots"


def check_export_args(cfg: ShramConfig, batch_size, prefill_chunk, eos_token_id, bos_token_id=None, *,
                      parallel=False, full_logits=False, verify_len=None) -> None:
    """Raises TypeError/ValueError on export arguments that cannot make a program (shared by
    .pte/.onnx), before anything is traced."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    for name, tid in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id)):
        if tid is not None and not 0 <= int(tid) < cfg.vocab_size:
            raise ValueError(f"{name} {tid} is outside the vocabulary [0, {cfg.vocab_size})")
    for name, flag in (("parallel", parallel), ("full_logits", full_logits)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    check_verify_len(verify_len)


def export_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in eval mode, every parameter and buffer contiguous, with the expert
    weights in the exported step's fused layout (`fuse_experts_`).

    WHY: exporting (and quantizing) must not touch the caller's model, and a caller may hand
    in transposed or sliced weights; the exporters and XNNPACK's weight serialisation are only
    exercised on the default row-major layout.
    """
    m = copy.deepcopy(model).eval()
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if not t.is_contiguous():
                t.data = t.data.contiguous()
    return fuse_experts_(m)


def graph_paths(path, verify: bool = False) -> dict[str, str]:
    """The files of one export: {"decode": m.onnx, "prefill": m.prefill.onnx, "data": m.onnx.data},
    and with `verify` also "verify": m.verify.onnx (an export with a verify step).

    Args:
        path: the decode graph's path (`m.onnx`).
    """
    path = os.fspath(path)
    stem = path[:-5] if path.endswith(".onnx") else path
    out = {"decode": path, "prefill": stem + ".prefill.onnx", "data": path + ".data"}
    if verify:
        out["verify"] = stem + ".verify.onnx"
    return out


def export_prefix_lengths(cfg: ShramConfig, lengths=None) -> tuple[int, ...]:
    """The prefix lengths an export's steps attend of each expert's sparse cache (the runners
    pick one per step, as `StaticDecoder` does): the steps take them as one input of bounded
    dynamic size, `slots` (P,) with lengths[0] <= P <= T.

    Args:
        cfg: the model config (T = `mosrah_cache_length`).
        lengths: None: `state.prefix_lengths(cfg)` (powers of two from 64 up to half the
            cache), the last the T real slots (no live slot is ever past T - 1; the sink, slot
            T, is never attended). Else ascending ints in [2, T]; T is added when missing.
            () or a single length T: whole-cache steps, no `slots` input.

    Returns:
        the lengths, ascending, the last T; () for whole-cache steps.

    Raises:
        ValueError: lengths that are not ascending ints in [2, T].
    """
    T = cfg.mosrah_cache_length
    if lengths is None:
        lengths = prefix_lengths(cfg)[:-1]
    lengths = tuple(lengths)
    if (any(isinstance(p, bool) or not isinstance(p, int) or not 2 <= p <= T for p in lengths)
            or any(a >= b for a, b in zip(lengths, lengths[1:]))):
        raise ValueError(f"prefix_lengths must be ascending ints in [2, {T}] (the sparse cache "
                         f"length), got {lengths!r}")
    if not lengths:
        return ()
    lengths = lengths if lengths[-1] == T else (*lengths, T)
    return lengths if len(lengths) > 1 else ()

