"""Deployable artifacts of the static steps: ExecuTorch (`.pte`) and ONNX, and loaders that
run them behind the `StaticDecoder` API (`prefill`, `decode`, `reset`, `generate`).

Imports of executorch / onnx / onnxruntime happen inside the functions, so importing this
package stays cheap (its modules import only torch and numpy at the top).
"""

from .onnx import export_onnx, load_onnx
from .pte import ExportFormatError, export_pte, load_pte

__all__ = ["export_pte", "load_pte", "export_onnx", "load_onnx", "ExportFormatError"]
