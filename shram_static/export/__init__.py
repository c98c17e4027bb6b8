"""Deployable artifacts of the static steps: ExecuTorch (`.pte`) and ONNX, and loaders that
run them behind the `StaticDecoder` API (`prefill`, `decode`, `reset`, `generate`).

Imports of executorch / onnx / onnxruntime happen inside the functions, so importing this
package stays cheap.
"""

from .pte import ExportFormatError


def export_pte(model, path, batch_size=1, prefill_chunk=32, quantize=None, eos_token_id=None,
               bos_token_id=None, *, quantize_embedding=False):
    """Writes an ExecuTorch program; see `shram_static.export.pte.export_pte`."""
    from .pte import export_pte as _export
    return _export(model, path, batch_size=batch_size, prefill_chunk=prefill_chunk,
                   quantize=quantize, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                   quantize_embedding=quantize_embedding)


def load_pte(path):
    """Loads a `.pte` as a decoder; see `shram_static.export.pte.load_pte`."""
    from .pte import load_pte as _load
    return _load(path)


def export_onnx(model, path, batch_size=1, prefill_chunk=32, eos_token_id=None):
    """Writes the ONNX decode and prefill graphs; see `shram_static.export.onnx.export_onnx`."""
    from .onnx import export_onnx as _export
    return _export(model, path, batch_size=batch_size, prefill_chunk=prefill_chunk,
                   eos_token_id=eos_token_id)


def load_onnx(path, inplace=True, threads=None):
    """Loads ONNX graphs as a decoder; see `shram_static.export.onnx.load_onnx`."""
    from .onnx import load_onnx as _load
    return _load(path, inplace=inplace, threads=threads)


__all__ = ["export_pte", "load_pte", "export_onnx", "load_onnx", "ExportFormatError"]
