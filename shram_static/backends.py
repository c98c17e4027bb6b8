"""Decoders by backend name, shared by `shram-static generate` and `shram-static eval`.

`eager` and `compiled` are `StaticDecoder`s, `compiled-int8` and `compiled-int4` compiled ones with
weight-only quantized linear layers (`quantized.py`); `pte`, `pte-int8`, `pte-8da4w`, `onnx`,
`onnx-int8` and `onnx-int4` export the model into a temporary directory (removed by the caller's
`ExitStack`) and load the artifact,
so a user can check an export or a quantization end to end from one command.
"""

import contextlib
import dataclasses
import os
import tempfile
import time

from .console import info


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend.

    Attributes:
        name: the name every command takes (`--backend`, `--backends`).
        runtime: "eager" or "compiled" (`StaticDecoder`), "pte" (ExecuTorch) or "onnx" (onnxruntime).
        quantize: the weight quantization, None for float weights.
        speculative: `bench-speculative` runs it (a verify step of k + 1 tokens).
    """

    name: str
    runtime: str
    quantize: str | None = None
    speculative: bool = True


# The one declaration of the backends: the CLI's choices, `bench`, `bench-speculative`,
# `export --quantize` and every quantizer's accepted modes derive from it.
TABLE = (
    Backend("eager", "eager"),
    Backend("compiled", "compiled"),
    Backend("compiled-int8", "compiled", "int8"),
    Backend("compiled-int4", "compiled", "int4"),
    Backend("pte", "pte"),
    Backend("pte-int8", "pte", "int8", speculative=False),
    Backend("pte-8da4w", "pte", "8da4w", speculative=False),
    Backend("onnx", "onnx"),
    Backend("onnx-int8", "onnx", "int8"),
    Backend("onnx-int4", "onnx", "int4"),
)
BACKENDS = tuple(b.name for b in TABLE)
SPEC_BACKENDS = tuple(b.name for b in TABLE if b.speculative)
EXPORTED = ("pte", "onnx")  # the runtimes that run an exported file


def find_backend(name: str) -> Backend:
    """The `Backend` called `name`; ValueError naming the choices for an unknown one."""
    for b in TABLE:
        if b.name == name:
            return b
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def quantize_modes(runtime: str) -> tuple[str, ...]:
    """The weight quantizations the backends of `runtime` offer ("compiled" covers eager too)."""
    return tuple(b.quantize for b in TABLE if b.runtime == runtime and b.quantize)


def float_partner(name: str) -> str | None:
    """The float backend of a quantized one's runtime (`pte-int8` -> `pte`), else None."""
    b = find_backend(name)
    return next(f.name for f in TABLE if f.runtime == b.runtime and f.quantize is None) if b.quantize else None


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
        verify_len: tokens of the verify step (speculative decoding), written into an exported
            artifact; None: none in an export, the default (5) for eager and compiled.
        full_logits: an export's prefill step returns every token's logits (what `eval`
            scores), not only each row's last token's (what generation reads; faster).

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
    if spec.runtime == "onnx":
        path = os.path.join(tmp, "model.onnx")
        info(f"exporting to ONNX{f' ({quantize})' if quantize else ''} ({path}) ...")
        export_onnx(model, path, batch_size=batch_size, prefill_chunk=prefill_chunk, eos_token_id=eos_token_id,
                    verify_len=verify_len, full_logits=full_logits, quantize=quantize)
        dec = load_onnx(path)
    else:
        path = os.path.join(tmp, "model.pte")
        info(f"exporting to ExecuTorch{f' ({quantize})' if quantize else ''} ({path}); lowering takes "
              f"a minute or more ...")
        export_pte(model, path, batch_size=batch_size, prefill_chunk=prefill_chunk, quantize=quantize,
                   eos_token_id=eos_token_id, bos_token_id=bos_token_id, verify_len=verify_len,
                   full_logits=full_logits)
        dec = load_pte(path)
    info(f"exported and loaded in {time.perf_counter() - t0:.1f} s")
    return dec
