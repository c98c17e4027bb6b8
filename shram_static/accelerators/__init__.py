"""Accelerators: every speed-up that patches or re-implements a private internal of torch, ExecuTorch
or onnxscript, registered with the releases it was verified on (`registry.py`). Where one is off
(another release, `SHRAM_STATIC_STOCK`, `set_stock(True)`, `stock()`), the stock path runs: the same
program, the same tokens. What each buys: docs/performance.md. Importing this imports neither torch
nor ExecuTorch (each name is imported when first used). The rest of the package reaches them through
these names only, each wrapping a whole stage:
  * `set_stock`, `stock`, `enabled`, `check_versions`: the switches and the version check;
  * `prepare_compile(device_type)`: once, when a compiled step is built (nothing per call);
  * `dynamic_length()`: once, when a decoder is built; `dynamic_length(t)`: once per compiled step;
  * `lowering()`: the block around ExecuTorch's `to_edge`/`to_backend`/`to_executorch` stages;
  * `export_and_lower(...)`: `torch.export.export` -> `to_edge_transform_and_lower`;
  * `run_jobs(...)`, `lower_in_parallel(...)`: independent jobs in forked processes;
  * `onnx_export()`: the block around `torch.onnx.export`;
  * `share_packed_weights()`: before a `.pte` is loaded (XNNPACK's weight cache).
"""

import contextlib
import importlib

from .registry import UnsupportedVersionError, check_versions, enabled, set_stock, stock  # noqa: F401

_LAZY = {"share_packed_weights": "backend_options", "lower_in_parallel": "edge_transfer",
         "run_jobs": "forked", "export_and_lower": "one_trace", "onnx_export": "onnx_rules"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


def prepare_compile(device_type: str = "cpu") -> None:
    """Readies this process for `torch.compile` when a compiled step is built (idempotent): where
    verified, Inductor's vector-ISA check starts in a background thread (`device_type` "cpu") and
    every later Dynamo compile builds its C++ kernels a few files at a time."""
    from . import cpu_isa, kernel_builds

    if device_type == "cpu":
        cpu_isa.start_isa_checks()
    kernel_builds.hook_compiles()


def dynamic_length(t=None) -> bool:
    """With `t` None: whether compiled steps take the prefix length as a dynamic size, asked once,
    when a decoder is built (False where off: it keeps one length, the whole cache). With `t` (a
    compiled step's `slots`, before its first call, of a decoder built with several lengths):
    marks its dim 0 dynamic for Dynamo (`maybe_`: Inductor's guards on it kept), as decided then."""
    if t is None:
        return enabled("dynamic_prefix")
    import torch._dynamo

    torch._dynamo.maybe_mark_dynamic(t, 0)
    return True


@contextlib.contextmanager
def lowering():
    """Within the block, ExecuTorch's lowering stages do only the work whose result is kept
    (`recompiles`, `edge_passes`, `partitioning`): the stock program, byte for byte. Each patch
    owns what it replaces, so they are entered in any order."""
    from .edge_passes import edge_program_passes, needed_xnnpack_passes_only
    from .partitioning import faster_partitioning
    from .recompiles import lazy_recompiles

    with lazy_recompiles(), edge_program_passes(), needed_xnnpack_passes_only(), faster_partitioning():
        yield


