"""The backends, declared once (`TABLE`): each name every command takes, the runtime that runs
it and its weight quantization; the CLI's choices and each quantizer's modes derive from it.
A leaf module: it imports nothing.
"""

import dataclasses


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
