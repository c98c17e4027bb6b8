"""The accelerators' registry (the private internals each touches, the releases it was verified
on), the switches that turn them off, the supported-version check, and `patched` (every patch's
set-and-restore).

An accelerator runs only where every package it touches is at a verified release; elsewhere the
stock path runs and one debug-level line says so. `SHRAM_STATIC_STOCK=1` (or `set_stock(True)`,
`with stock():`) turns every one off; `SHRAM_STATIC_STOCK=name,name` only the named ones.
A leaf module: it imports neither torch nor ExecuTorch (versions come from package metadata).
"""

import contextlib
import dataclasses
import functools
import logging
import os
import re
from importlib import metadata

log = logging.getLogger(__name__)

STOCK_ENV = "SHRAM_STATIC_STOCK"

# The releases the accelerators were verified on (their tests pass, stock and accelerated
# paths compared); a local build tag (`+cpu`, `+cu130`) is ignored.
TORCH = ("2.13.0", "2.14.1", "2.15.0")
EXECUTORCH = ("1.4.1", "1.5.1")
ONNXSCRIPT = ("0.7.2",)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator: its name (for `SHRAM_STATIC_STOCK`, `enabled`), where it is applied (module.function
    here), the private internals it touches, and `verified`: distribution -> the verified releases."""

    name: str
    where: str
    internals: str
    verified: dict


def _acc(name, where, internals, **verified) -> Accelerator:
    return Accelerator(name, where, internals, {k.replace("_", "-"): v for k, v in verified.items()})


REGISTRY: dict[str, Accelerator] = {a.name: a for a in [
    # compiled steps (torch.compile)
    _acc("isa_check_ahead", "cpu_isa.start_isa_checks",
         "torch._inductor.cpu_vec_isa.valid_vec_isa_list", torch=TORCH),
    _acc("dynamic_prefix", "dynamic_length", "torch._dynamo.maybe_mark_dynamic", torch=TORCH),
    _acc("batched_kernel_builds", "kernel_builds.hook_compiles",
         "torch._inductor.async_compile.AsyncCompile.cpp_pybinding, CppPythonBindingsCodeCache templates; "
         "torch._dynamo.callback.callback_handler", torch=TORCH),
    # .pte lowering (each leaves the program as the stock lowering writes it)
    _acc("one_trace_lowering", "one_trace.export_and_lower",
         "torch.export._trace._export/_export_to_aten_ir; executorch.exir.program._program "
         "._generate_edge_program/_default_decomposition_table", torch=TORCH, executorch=EXECUTORCH),
    _acc("needed_xnnpack_passes", "edge_passes.needed_xnnpack_passes_only",
         "executorch.backends.xnnpack._passes.XNNPACKPassManager.__init__", executorch=EXECUTORCH),
    _acc("needed_edge_passes", "edge_passes.edge_program_passes",
         "executorch.exir.program._program._get_aten_to_edge_passes/edge_to_executorch_passes",
         executorch=EXECUTORCH),
    _acc("one_edge_conversion_trace", "edge_passes.edge_program_passes",
         "executorch.exir.program._program._generate_edge_program and its pass classes; "
         "torch._export.passes.ReplaceViewOpsWithViewCopyOpsPass", torch=TORCH, executorch=EXECUTORCH),
    _acc("linear_partitioning", "partitioning.faster_partitioning",
         "GroupBasedPartitioner._can_merge_partitions; lowered_backend_module.legalize_graph",
         torch=TORCH, executorch=EXECUTORCH),
    _acc("lazy_recompiles", "recompiles.lazy_recompiles",
         "torch.fx.GraphModule.recompile/code/__str__", torch=TORCH),
    _acc("parallel_lowering", "forked.run_jobs + edge_transfer",
         "executorch.exir.serde; LoweredBackendModule._named_data_store_output", torch=TORCH,
         executorch=EXECUTORCH),
    # .pte runtime
    _acc("xnnpack_weight_cache", "backend_options.share_packed_weights",
         "executorch::runtime::set_option/get_option (C++ symbols of lib/libexecutorch.so, through ctypes) "
         "and the layout of executorch::runtime::BackendOption", executorch=("1.5.1",)),
    # .onnx export
    _acc("skip_onnx_slices_split", "onnx_rules.without_onnx_rewrite_rules",
         "onnxscript.rewriter._DEFAULT_REWRITE_RULES", onnxscript=ONNXSCRIPT),
]}

_stock: bool | None = None  # set_stock's value; None: the environment decides


def set_stock(value: bool | None) -> None:
    """Turns every accelerator off (True), on where verified (False), or leaves the choice to
    `SHRAM_STATIC_STOCK` (None, the default). A step compiled before keeps what it compiled with."""
    global _stock
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"set_stock takes True, False or None, got {value!r}")
    _stock = value


@contextlib.contextmanager
def stock():
    """Every accelerator off within the block (`set_stock(True)`), the previous choice after."""
    global _stock
    before = _stock
    _stock = True
    try:
        yield
    finally:
        _stock = before


@contextlib.contextmanager
def patched(owner, **attrs):
    """Sets `attrs` on `owner` (a module or class) within the block; their previous values after."""
    saved = {n: getattr(owner, n) for n in attrs}
    for n, v in attrs.items():
        setattr(owner, n, v)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(owner, n, v)


def _env_off(raw: str) -> frozenset | bool:
    """True (all off), or the names `SHRAM_STATIC_STOCK` (`raw`) turns off."""
    raw = raw.strip()
    if raw.lower() in ("", "0", "false", "no", "off"):
        return frozenset()
    if raw.lower() in ("1", "true", "yes", "on", "all"):
        return True
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    if unknown := sorted(names - set(REGISTRY)):
        _log_once(("env", raw), logging.WARNING, "%s=%r names no accelerator: %s (known: %s)",
                  STOCK_ENV, raw, ", ".join(unknown), ", ".join(REGISTRY))
    return names


@functools.cache
def installed_version(dist: str) -> str | None:
    """The installed release of a distribution ('2.14.1' for '2.14.1+cu130'), None if not installed."""
    try:
        return metadata.version(dist).split("+", 1)[0]
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _log_once(key, level, msg, *args) -> None:
    log.log(level, msg, *args)


def unverified(name: str) -> list[str]:
    """'torch 2.15.0' for each package the accelerator touches that is not at a verified release."""
    return [f"{dist} {installed_version(dist)}" for dist, ok in REGISTRY[name].verified.items()
            if installed_version(dist) not in ok]


def enabled(name: str) -> bool:
    """Whether the accelerator `name` runs here: not turned off (`set_stock`, `stock()`, the environment)
    and every package it touches at a verified release. Decided once per switch setting (`decide`).

    Raises:
        KeyError: `name` is not registered.
    """
    return decide(name, _stock, os.environ.get(STOCK_ENV, ""))


@functools.cache
def decide(name: str, stock_switch: bool | None, env: str) -> bool:
    """`enabled(name)` for one setting of the Python switch and of `SHRAM_STATIC_STOCK`."""
    if name not in REGISTRY:
        raise KeyError(f"no accelerator {name!r}; registered: {', '.join(REGISTRY)}")
    if stock_switch is True:
        return False
    if stock_switch is None:
        off = _env_off(env)
        if off is True or name in off:
            log.debug("accelerator %s off (%s); the stock path runs", name, STOCK_ENV)
            return False
    if bad := unverified(name):
        verified = "; ".join(f"{d} {', '.join(v)}" for d, v in REGISTRY[name].verified.items())
        _log_once((name, "versions"), logging.DEBUG,
                  "accelerator %s off: %s not among the releases it was verified on (%s); "
                  "the stock path runs",
                  name, ", ".join(bad), verified)
        return False
    return True


# Checked when the package is imported: the oldest release of each core dependency, the newest line tested.
SUPPORTED = {"torch": ((2, 13), (2, 15)), "executorch": ((1, 4), (1, 5))}


class UnsupportedVersionError(ImportError):
    """An installed torch or ExecuTorch older than this package supports."""


def _major_minor(v: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def supported_text() -> str:
    """'torch 2.13-2.15, executorch 1.4-1.5'."""
    return ", ".join(f"{d} {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}" for d, (lo, hi) in SUPPORTED.items())


def check_versions(versions: dict | None = None) -> list[str]:
    """Checks torch and ExecuTorch against `SUPPORTED`.

    Args:
        versions: distribution -> version (None: not installed); default the installed ones.

    Returns:
        One line per package newer than the newest release line tested (its accelerators off).

    Raises:
        UnsupportedVersionError: torch missing, or torch / ExecuTorch older than supported.
    """
    if versions is None:
        versions = {d: installed_version(d) for d in SUPPORTED}
    newer = []
    for dist, (lo, hi) in SUPPORTED.items():
        v = versions.get(dist)
        if v is None:
            if dist == "torch":
                raise UnsupportedVersionError(f"shram_static needs torch ({supported_text()}); "
                                              f"none is installed: pip install 'torch>={lo[0]}.{lo[1]}'")
            continue
        if (mm := _major_minor(v)) is None:
            continue  # a development build without a release number: let it run
        if mm < lo:
            raise UnsupportedVersionError(
                f"shram_static supports {supported_text()}; {dist} {v} is installed. "
                f"pip install -U '{dist}>={lo[0]}.{lo[1]}' (or a release of shram_static made for it)")
        if mm > hi:
            newer.append(f"{dist} {v} is newer than the releases shram_static was tested with "
                         f"({supported_text()}); its accelerators are off (the stock paths run)")
    return newer
