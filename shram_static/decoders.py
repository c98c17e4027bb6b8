"""Decoders by backend name (`backends.TABLE`), shared by `generate`, `eval`, `bench-speculative`
and `serve`. Torch backends are `StaticDecoder`s; export backends export the model into a
temporary directory (removed by the caller's `ExitStack`) and load the artifact.
"""

import contextlib
import os
import tempfile
import time

from .backends import find_backend
from .console import info


def make_decoder(model, backend: str, prefill_chunk: int, stack: contextlib.ExitStack,
                 eos_token_id: int | None = None, bos_token_id: int | None = None,
                 batch_size: int = 1, verify_len: int | None = None, full_logits: bool = False):
    """A decoder of `model` on `backend` (batch 1 unless `batch_size` says otherwise).

    Args:
        model: a `ShramForCausalLM` (not modified).
        backend: one of `BACKENDS`.
        prefill_chunk: tokens per prefill step.
        stack: owns the temporary directory of an export backend.
        eos_token_id, bos_token_id: stored in an exported program (and used by `generate`).
        batch_size: rows per step (`shram-static serve` runs one request per row).
        verify_len: tokens of the verify step; None: none in an export, the default for torch.
        full_logits: an export's prefill step returns every token's logits (what `eval` scores).

    Returns:
        A `HostDecoder` (`prefill`, `decode`, `reset`, `generate`).

    Raises:
        ValueError: an unknown backend, or an export backend whose module cannot be imported.
    """
    spec = find_backend(backend)
    quantize = spec.quantize
    if spec.runtime in ("eager", "compiled"):
        from .decoder import StaticDecoder
        return StaticDecoder(model, batch_size=batch_size, prefill_chunk=prefill_chunk,
                             compile=spec.runtime == "compiled", eos_token_id=eos_token_id, quantize=quantize,
                             **({"verify_len": verify_len} if verify_len else {}))
    try:
        from .export import export_onnx, export_pte, load_onnx, load_pte
    except ImportError as e:
        raise ValueError(f"backend {backend!r} needs shram_static.export, which failed to import: {e}") from e
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="shram_static_"))
    t0 = time.perf_counter()
    onnx = spec.runtime == "onnx"
    path = os.path.join(tmp, "model.onnx" if onnx else "model.pte")
    info(f"exporting to {'ONNX' if onnx else 'ExecuTorch'}{f' ({quantize})' if quantize else ''} ({path})"
         f"{'' if onnx else '; lowering takes a minute or more'} ...")
    kw = dict(batch_size=batch_size, prefill_chunk=prefill_chunk, quantize=quantize,
              eos_token_id=eos_token_id, verify_len=verify_len, full_logits=full_logits)
    if onnx:
        export_onnx(model, path, **kw)
    else:
        export_pte(model, path, bos_token_id=bos_token_id, **kw)
    dec = (load_onnx if onnx else load_pte)(path)
    info(f"exported and loaded in {time.perf_counter() - t0:.1f} s")
    return dec
