"""Deployable artifacts of the static steps: ExecuTorch (`.pte`) and ONNX, and loaders that
run them behind the `StaticDecoder` API (`prefill`, `decode`, `reset`, `generate`).

Exporters (`pte.py`, `onnx.py`) and runtime loaders (`pte_runtime.py`, `onnx_runtime.py`) are
separate modules; what both need is in `common.py`. Imports of executorch / onnx / onnxruntime
happen inside the functions, so importing this package stays cheap (its modules import only
torch and numpy at the top).
"""

from ..errors import ExportFormatError
from .onnx import export_onnx
from .onnx_runtime import load_onnx
from .pte import export_pte
from .pte_runtime import load_pte

__all__ = ["export_pte", "load_pte", "export_onnx", "load_onnx", "ExportFormatError"]
