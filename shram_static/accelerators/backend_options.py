"""ExecuTorch runtime backend options that its Python bindings give no way to set:
`share_packed_weights()` turns on XNNPACK's weight cache before a program is loaded, so a `.pte`'s
methods (and later programs) share one packed copy of each weight. WHY: XNNPACK packs every constant
weight per delegate (docs/performance.md, "`.pte`"). The runtime's public C++ `set_option` is not
exposed to Python: it is called through ctypes on the library the bindings load (ExecuTorch 1.5.1's
`lib/libexecutorch.so`), read back with `get_option`; any failure leaves the stock behaviour. The
cache is keyed by content hashes, so programs of different models never share a weight.
"""

import ctypes
import logging
import os

from .registry import enabled

log = logging.getLogger(__name__)

BACKEND = b"XnnpackBackend"
KEY = b"weight_cache_enabled"
_SET = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_GET = "_ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"


class _BackendOption(ctypes.Structure):
    """`executorch::runtime::BackendOption` (runtime/backend/options.h, ExecuTorch 1.5.1):
    `char key[64]` and a `std::variant<bool, int, std::array<char, 256>>` (libstdc++: 256 bytes
    of storage, then the alternative's index in one byte, padded to the int's alignment)."""

    _fields_ = [("key", ctypes.c_char * 64), ("value", ctypes.c_ubyte * 256), ("index", ctypes.c_ubyte),
                ("_pad", ctypes.c_ubyte * 3)]


_state: bool | None = None  # None: not tried in this process


def _runtime_library():
    """The runtime library the Python bindings loaded (dlopen of a loaded path returns it)."""
    import executorch
    from executorch.extension.pybindings import portable_lib  # noqa: F401  (loads it, registers the backends)
    return ctypes.CDLL(os.path.join(list(executorch.__path__)[0], "lib", "libexecutorch.so"))


def _call(fn, opt: _BackendOption) -> int:
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]  # Span<BackendOption>: pointer, size
    fn.restype = ctypes.c_uint32  # executorch::runtime::Error; 0 is Ok
    return fn(BACKEND, ctypes.addressof(opt), 1)


def weight_cache_enabled() -> bool:
    """Whether XNNPACK's weight cache is on in this process (False where `get_option` is unreachable)."""
    try:
        opt = _BackendOption(key=KEY)
        return _call(getattr(_runtime_library(), _GET), opt) == 0 and opt.index == 0 and opt.value[0] == 1
    except (OSError, AttributeError, ImportError):
        return False


def share_packed_weights() -> bool:
    """Turns XNNPACK's weight cache on for this process, once, where `xnnpack_weight_cache` is
    enabled; returns whether it is on. Programs loaded before the first call keep their own packed
    weights; once on, it stays on (a later `SHRAM_STATIC_STOCK` or `set_stock(True)` does not undo it)."""
    global _state
    if _state is not None or not enabled("xnnpack_weight_cache"):
        return bool(_state)
    _state = False
    try:
        opt = _BackendOption(key=KEY)
        opt.value[0], opt.index = 1, 0  # bool true
        err = _call(getattr(_runtime_library(), _SET), opt)
        _state = err == 0 and weight_cache_enabled()
        why = f"set_option returned {err}"
    except (OSError, AttributeError, ImportError) as e:
        why = e
    if not _state:
        log.debug("XNNPACK weight cache not enabled (%s); each method packs its own weights", why)
    return _state
