"""Accelerators: every speed-up that patches or re-implements a private internal of torch
(Inductor, Dynamo, torch.fx, torch.export), ExecuTorch or onnxscript, each registered with the
releases it was verified on (`registry.py`). Where one is off (another release,
`SHRAM_STATIC_STOCK`, `set_stock(True)`, `stock()`), the stock path runs and writes the same
program, gives the same tokens. What each buys: docs/performance.md, "Accelerators".

The rest of the package reaches them through these names only, each wrapping a whole stage:
  * `set_stock`, `stock`, `enabled`, `check_versions`: the switches and the version check;
  * `prepare_compile(device_type)`: once, when a compiled step is built: Inductor's vector-ISA
    check started ahead (CPU) and the C++ kernels of every later compile built a few files at a
    time (Dynamo's compile callbacks: nothing is added to a compiled call);
  * `lowering()`: the block around ExecuTorch's `to_edge`/`to_backend`/`to_executorch` stages;
  * `export_and_lower(methods, partitioner, constant_methods, config)`: the stages
    `torch.export.export` -> `to_edge_transform_and_lower`, in one trace where verified;
  * `run_jobs(jobs, encode, decode, parallel)` and `lower_in_parallel(jobs, parallel)`:
    independent jobs in forked processes (lowered edge programs travel through ExecuTorch's serde);
  * `onnx_export()`: the block around `torch.onnx.export`;
  * `share_packed_weights()`: before a `.pte` is loaded (XNNPACK's weight cache).
Importing this package imports no compiler or exporter module (each is imported when used).
"""

import contextlib

from .backend_options import share_packed_weights  # noqa: F401
from .edge_transfer import lower_in_parallel  # noqa: F401
from .forked import run_jobs  # noqa: F401
from .one_trace import export_and_lower  # noqa: F401
from .registry import UnsupportedVersionError, check_versions, enabled, set_stock, stock  # noqa: F401


def prepare_compile(device_type: str = "cpu") -> None:
    """Readies this process for `torch.compile`: where verified, Inductor's vector-ISA check
    starts in a background thread (CPU), and every Dynamo compile from now on builds its C++
    kernels a few files at a time. Idempotent; call when a compiled step is built.

    Args:
        device_type: the device the compiled step runs on ("cpu", "cuda", ...).
    """
    from . import cpu_isa, kernel_builds

    if device_type == "cpu":
        cpu_isa.start_isa_checks()
    kernel_builds.hook_compiles()


@contextlib.contextmanager
def lowering():
    """Within the block, ExecuTorch's lowering stages do only the work whose result is kept:
    fx code generated once (`recompiles`), edge passes that cannot change the graph skipped and
    the per-operator conversions fused (`edge_passes`), partitioning linear in the partition
    count (`partitioning`). The program is the stock lowering's, byte for byte
    (tests/test_accelerators.py). Each patch owns what it replaces: entered in any order."""
    from .edge_passes import edge_program_passes, needed_xnnpack_passes_only
    from .partitioning import faster_partitioning
    from .recompiles import lazy_recompiles

    with lazy_recompiles(), edge_program_passes(), needed_xnnpack_passes_only(), faster_partitioning():
        yield


@contextlib.contextmanager
def onnx_export():
    """Within the block, `torch.onnx.export(optimize=True)` skips the onnxscript rewrite rules
    that never match a SHRAM step (`onnx_rules`); the same graphs."""
    from .onnx_rules import without_onnx_rewrite_rules

    with without_onnx_rewrite_rules():
        yield
