"""Deployable artifacts of the static steps: ExecuTorch (`.pte`) and ONNX, and loaders that
run them behind the `StaticDecoder` API (`prefill`, `decode`, `reset`, `generate`).

Exporters (`pte.py`, `onnx.py`) and loaders (`pte_runtime.py`, `onnx_runtime.py`) are separate
modules sharing `common.py`; the public functions are imported on first use (no torch here).
"""

from ..errors import ExportFormatError

# public name -> its module, imported on first use (`shram-static export --help` without torch)
_LAZY = {"export_pte": ".pte", "load_pte": ".pte_runtime", "export_onnx": ".onnx", "load_onnx": ".onnx_runtime"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shram_static.export' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["export_pte", "load_pte", "export_onnx", "load_onnx", "ExportFormatError"]
