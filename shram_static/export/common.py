"""What the exporters and the runtime loaders share: format ids, file names, argument checks,
and the model copy every export starts from."""

import copy
import os

import torch
from torch import nn

from ..config import ShramConfig
from ..fast_layers import fuse_experts_
from ..state import prefix_lengths
from ..validation import check_positive_ints, check_verify_len

PTE_FORMAT = "shram_static.pte/1"
PTE_MAGIC = b"ET12"  # file_identifier of the ExecuTorch flatbuffer (bytes 4..8)
ONNX_FORMAT = "shram_static.onnx/1"
SLOTS_INPUT = "slots"  # (P,) float32 `slot_numbers(T)[:P]`: the sparse slots a step attends


def check_export_args(cfg: ShramConfig, batch_size, prefill_chunk, eos_token_id, bos_token_id=None, *,
                      parallel=False, full_logits=False, verify_len=None) -> tuple[int | None, int | None]:
    """Raises TypeError/ValueError on export arguments that cannot make a program (shared by
    .pte/.onnx), before anything is traced; returns (eos_token_id, bos_token_id), the config's
    where None."""
    check_positive_ints(batch_size=batch_size, prefill_chunk=prefill_chunk)
    eos_token_id = getattr(cfg, "eos_token_id", None) if eos_token_id is None else eos_token_id
    bos_token_id = getattr(cfg, "bos_token_id", None) if bos_token_id is None else bos_token_id
    for name, tid in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id)):
        if tid is not None and not 0 <= int(tid) < cfg.vocab_size:
            raise ValueError(f"{name} {tid} is outside the vocabulary [0, {cfg.vocab_size})")
    for name, flag in (("parallel", parallel), ("full_logits", full_logits)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    check_verify_len(verify_len)
    return eos_token_id, bos_token_id


def export_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in eval mode, every parameter and buffer contiguous (the layout the
    exporters are exercised on), with the experts fused (`fuse_experts_`)."""
    m = copy.deepcopy(model).eval()
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if not t.is_contiguous():
                t.data = t.data.contiguous()
    return fuse_experts_(m)


def graph_paths(path, verify: bool = False, rows: bool = False) -> dict[str, str]:
    """The files of one export of `path` (`m.onnx`): {"decode": m.onnx, "prefill": m.prefill.onnx,
    "data": m.onnx.data}, with `verify` also {"verify": m.verify.onnx}, with `rows` also
    {"decode_rows": m.rows.onnx} (`export_onnx(row_writes=True)`)."""
    path = os.fspath(path)
    stem = path[:-5] if path.endswith(".onnx") else path
    out = {"decode": path, "prefill": stem + ".prefill.onnx", "data": path + ".data"}
    if verify:
        out["verify"] = stem + ".verify.onnx"
    if rows:
        out["decode_rows"] = stem + ".rows.onnx"
    return out


def export_prefix_lengths(cfg: ShramConfig, lengths=None) -> tuple[int, ...]:
    """The prefix lengths of each expert's sparse cache an export's steps attend (`slots` (P,),
    lengths[0] <= P <= T; the runners pick one per step).

    Args:
        cfg: the model config (T = `mosrah_cache_length`).
        lengths: None: powers of two from 64 up to half the cache (`state.prefix_lengths`),
            then T. Else ascending ints in [2, T]; T is added when missing. () or (T,):
            whole-cache steps, no `slots` input.

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
    if lengths and lengths[-1] != T:
        lengths = (*lengths, T)
    return lengths if len(lengths) > 1 else ()

