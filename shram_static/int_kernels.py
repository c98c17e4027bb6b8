"""Integer dot-product linears on CPU: the torch operators `shram_static::int4_linear` and
`shram_static::int8_linear` (csrc/int_linear.cpp), and the weight layout they read.

Each input row is quantized per call to int8 per block of BLOCK inputs (q8_0), times 4- or 8-bit
weights with an fp16 scale per block (q4_0 / q8_0), summed in int32; AVX-512 VNNI, AVX2 and
portable paths give the same results. The C++ is built at first use (`load`, cached in torch's
extension directory); where that fails the layers take their float path. `SHRAM_STATIC_INT_KERNELS`:
unset or `auto`, the best path; `portable`, `avx2` or `avx512_vnni`; `off`, the float path.
"""
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from .console import quiet_loggers

BLOCK = 32  # inputs per scale, of the activations and of the weights
LANES = 16  # outputs per block of the packed weight
ISAS = {"portable": 1, "avx2": 2, "avx512_vnni": 3}  # the op's `isa` codes (0: the best)
ENV = "SHRAM_STATIC_INT_KERNELS"
SOURCE = Path(__file__).parent / "csrc" / "int_linear.cpp"
# WHY no contraction: the same float sequence on every path
CFLAGS = ["/O2", "/fp:precise"] if sys.platform == "win32" else ["-O3", "-ffp-contract=off"]
# WHY: at::parallel_for over OpenMP is a pragma in ATen's headers; a build without the compiler's
# OpenMP flag runs it on one thread (macOS's compiler has none by default). Compile flags only:
# unlinked, the ops bind the OpenMP runtime torch loaded, not a second one with threads of its own
if torch.backends.openmp.is_available() and sys.platform != "darwin":
    CFLAGS.append("/openmp" if sys.platform == "win32" else "-fopenmp")

ISA: int | None = None  # after `load`: the op's `isa` argument for the layers, or None (float path)
_loaded: bool | None = None  # `load`'s result, None before it ran
_faked: set[str] = set()  # ops with a fake implementation registered


def parse_isa(value: str | None) -> int | None:
    """The `isa` code an `ENV` value asks for: 0 (best) for None/""/"auto", None for "off".

    Raises:
        ValueError: an unknown value.
    """
    value, codes = (value or "auto").strip().lower(), {"auto": 0, "off": None, **ISAS}
    if value not in codes:
        raise ValueError(f"{ENV} must be auto, off or one of {sorted(ISAS)}, got {value!r}")
    return codes[value]


def build(loader=None) -> bool:
    """Builds (or finds in torch's extension cache) and loads the C++ operators.

    Args:
        loader: `torch.utils.cpp_extension.load` or a stand-in with its signature.

    Returns:
        True when the operators are registered; False, with one warning, where that failed.
    """
    try:
        if loader is None:
            # WHY quiet: importing the loader logs a warning about CUDA on a CPU-only machine
            with quiet_loggers("torch.utils.cpp_extension"):
                from torch.utils import cpp_extension
            loader = cpp_extension.load
            root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        else:
            root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
        text = SOURCE.read_bytes()
        tag = hashlib.sha256(text + " ".join(CFLAGS + [torch.__version__, sys.version]).encode()).hexdigest()[:12]
        name = f"shram_static_int_kernels_{tag}"
        where = Path(root) / name
        where.mkdir(parents=True, exist_ok=True)
        if not any(where.glob(f"{name}.*")):
            print(f"building shram_static's integer kernels (once; cached in {where}) ...", file=sys.stderr)
        loader(name, [str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(where), is_python_module=False,
               verbose=False)
        _register_fakes()
        return True
    except Exception as e:  # noqa: BLE001 (no compiler, a failed build: the float path serves)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"shram_static's integer kernels could not be built ({first}); the int8/int4 layers "
                      "use their float path (dequantized weights)", RuntimeWarning, stacklevel=2)
        return False


def _register_fakes() -> None:
    """The ops' fake implementations (a step calling them compiles fullgraph), once per process."""
    def fake(x, packed, scale, out_features, isa=0):
        return x.new_empty((*x.shape[:-1], out_features))

    for op in ("int4_linear", "int8_linear"):
        if op not in _faked:
            torch.library.register_fake(f"shram_static::{op}")(fake)
            _faked.add(op)


def load() -> int | None:
    """Builds and loads the operators once per process (unless `ENV` says `off`) and sets `ISA`.

    Returns:
        `ISA`: the `isa` argument the layers pass, or None (their float path).

    Raises:
        ValueError: `ENV` holds an unknown value, or names a path this CPU lacks.
    """
    global ISA, _loaded
    if _loaded is None:
        want = parse_isa(os.environ.get(ENV))
        ok = want is not None and build()
        if ok and want and want > best_isa():
            best = next(name for name, code in ISAS.items() if code == best_isa())
            raise ValueError(f"{ENV} asks for a path this CPU lacks (best: {best})")
        ISA, _loaded = (want if ok else None), ok
    return ISA


def best_isa() -> int:
    """The best path of this CPU (an `ISAS` code). Needs the operators (`build`)."""
    return int(torch.ops.shram_static.int_kernel_isa())


def int_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int, bits: int,
               isa: int = 0) -> torch.Tensor:
    """(..., in) -> (..., out) in x's dtype, through the integer op of `bits` (4 or 8), on CPU.

    Args:
        x, packed, scale, out_features, bits: activations, and the weight as `pack` made it.
        isa: 0 (the CPU's best path) or an `ISAS` code.
    """
    op = torch.ops.shram_static.int4_linear if bits == 4 else torch.ops.shram_static.int8_linear
    return op(x.float(), packed, scale, out_features, isa).to(x.dtype)


def pack(q: torch.Tensor, s: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' layout of a quantized weight (see csrc/int_linear.cpp).

    Args:
        q: (out, in) integers: in [-8, 7] (bits 4) or [-127, 127] (bits 8).
        s: (out, ceil(in / BLOCK)) scales, w ~ q * s per block of BLOCK inputs (fp16 values).
        bits: 4 or 8.

    Returns:
        packed (ceil(out / LANES), blocks, 4 or 8, 64) uint8, scale (ceil(out / LANES), blocks,
        LANES) fp16; padding is zero weights (and scales).
    """
    N, K = q.shape
    G, nb = s.shape[1], -(-N // LANES)
    qp = torch.zeros(nb * LANES, G * BLOCK, dtype=torch.int32)
    qp[:N, :K] = q.to(torch.int32)
    sp = torch.zeros(nb * LANES, G, dtype=torch.float16)
    sp[:N] = s.to(torch.float16)
    if bits == 4:
        u = (qp + 8).view(nb, LANES, G, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # (nb, G, c, o, half, j)
        b = u[..., 0, :] | (u[..., 1, :] << 4)  # (nb, G, 4, LANES, 4)
    else:
        b = (qp + 128).view(nb, LANES, G, 8, 4).permute(0, 2, 3, 1, 4)  # (nb, G, c, o, j)
    packed = b.to(torch.uint8).reshape(nb, G, -1, LANES * 4).contiguous()
    return packed, sp.view(nb, LANES, G).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, scale: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s inverse, with its padding: (q (nb * LANES, blocks * BLOCK) int32, s (nb * LANES,
    blocks) float32)."""
    nb, G = packed.shape[:2]
    b = packed.to(torch.int32)
    if bits == 4:
        b = b.view(nb, G, 4, LANES, 1, 4)
        u = torch.cat([b & 15, b >> 4], 4).permute(0, 3, 1, 2, 4, 5) - 8  # (nb, o, G, c, half, j)
    else:
        u = b.view(nb, G, 8, LANES, 4).permute(0, 3, 1, 2, 4) - 128  # (nb, o, G, c, j)
    return u.reshape(nb * LANES, G * BLOCK), scale.transpose(1, 2).reshape(nb * LANES, G).float()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, bits: int, out_features: int,
               in_features: int) -> torch.Tensor:
    """The (out, in) float32 weight that `pack` holds."""
    q, s = unpack(packed, scale, bits)
    w = q.float().view(q.shape[0], -1, BLOCK) * s[..., None]
    return w.view(q.shape[0], -1)[:out_features, :in_features]


def float_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bits: int, out_features: int,
                 in_features: int) -> torch.Tensor:
    """The float path: `x` times the dequantized weight (no activation quantization)."""
    return F.linear(x.float(), dequantize(packed, scale, bits, out_features, in_features)).to(x.dtype)
