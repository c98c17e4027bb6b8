"""Integer dot-product linears on CPU: the torch operators `shram_static::int4_linear` and
`shram_static::int8_linear` (csrc/int_linear.cpp), and the weight layout they read.

Each input row is quantized once per call to int8 in blocks of BLOCK inputs (one float scale
per block, llama.cpp's q8_0), multiplied by 4-bit or 8-bit weights with one fp16 scale per
block of BLOCK inputs of an output (q4_0 / q8_0), each block's products summed in int32.
Paths: AVX-512 VNNI, AVX2 and portable C++, picked per call by the CPU's features; the float
arithmetic is the same sequence on every path, so they give the same results.

The C++ is built at first use by torch's extension loader (`torch.utils.cpp_extension.load`,
cached in torch's extension directory, one status line while it builds), as Inductor builds its
own kernels. Where that fails (no compiler), `load` warns once and the layers take their float
path. Each op has a fake implementation, so a step calling it compiles with `fullgraph=True`;
Inductor calls it as an external kernel.

`SHRAM_STATIC_INT_KERNELS` (read once, at the first `load`): unset or `auto`, the best path;
`portable`, `avx2` or `avx512_vnni`, that path; `off`, the layers' float path.
"""

import hashlib
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

BLOCK = 32  # inputs per scale, of the activations and of the weights
LANES = 16  # outputs per block of the packed weight
ISAS = {"portable": 1, "avx2": 2, "avx512_vnni": 3}  # the op's `isa` codes (0: the best)
ENV = "SHRAM_STATIC_INT_KERNELS"
SOURCE = Path(__file__).parent / "csrc" / "int_linear.cpp"
# WHY no contraction: the same float sequence on every path
CFLAGS = ["/O2", "/fp:precise"] if sys.platform == "win32" else ["-O3", "-ffp-contract=off"]

ISA: int | None = None  # after `load`: the op's `isa` argument for the layers, or None (float path)
_loaded: bool | None = None  # whether `load` has run in this process (and its result)
_faked: set[str] = set()  # the ops whose fake implementation is registered


def parse_isa(value: str | None) -> int | None:
    """The `isa` code an `ENV` value asks for: 0 (best) for None/""/"auto", None for "off".

    Raises:
        ValueError: an unknown value."""
    value = (value or "auto").strip().lower()
    if value == "auto":
        return 0
    if value == "off":
        return None
    if value not in ISAS:
        raise ValueError(f"{ENV} must be auto, off or one of {sorted(ISAS)}, got {value!r}")
    return ISAS[value]


def build(loader=None) -> bool:
    """Builds (or finds in torch's extension cache) and loads the C++ operators.

    Args:
        loader: `torch.utils.cpp_extension.load` or a stand-in with its signature.

    Returns:
        True when the operators are registered; False, with one warning, where the build or the
        load failed (the layers then take their float path).
    """
    try:
        if loader is None:
            # WHY quiet: importing the loader logs a warning about CUDA on a CPU-only machine
            quiet = logging.getLogger("torch.utils.cpp_extension")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                from torch.utils import cpp_extension
            finally:
                quiet.setLevel(level)
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
    """The ops' fake implementations (output shape and dtype), once per process."""
    def fake(x, packed, scale, out_features, isa=0):
        return x.new_empty((*x.shape[:-1], out_features))

    for op in ("int4_linear", "int8_linear"):
        if op not in _faked:
            torch.library.register_fake(f"shram_static::{op}")(fake)
            _faked.add(op)


def load() -> int | None:
    """Builds and loads the operators once per process (where `ENV` does not say `off`) and sets
    `ISA`. Returns `ISA`: the `isa` argument the layers pass, or None (their float path).

    Raises:
        ValueError: `ENV` holds an unknown value, or names a path this CPU lacks."""
    global ISA, _loaded
    if _loaded is None:
        want = parse_isa(os.environ.get(ENV))
        ok = want is not None and build()
        if ok and want and want > best_isa():
            raise ValueError(f"{ENV} asks for a path this CPU lacks (best: {isa_name(best_isa())})")
        ISA, _loaded = (want if ok else None), ok
    return ISA


def best_isa() -> int:
    """The best path of this CPU (an `ISAS` code). Needs the operators (`build`)."""
    return int(torch.ops.shram_static.int_kernel_isa())


def isa_name(code: int) -> str:
    """The `ISAS` name of a code."""
    return {v: k for k, v in ISAS.items()}[code]


def int_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int, bits: int,
               isa: int = 0) -> torch.Tensor:
    """(..., in) -> (..., out) in x's dtype, through the integer op of `bits` (4 or 8).

    Args:
        x: activations on CPU (computed in float32).
        packed, scale: the weight as `pack` made it.
        out_features: the weight's output count.
        bits: 4 or 8.
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
        LANES) fp16; padding outputs and inputs are zero weights (padding outputs: scale 0).
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
