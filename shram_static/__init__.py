"""shram_static: SHRAM language models from static graphs: fixed-shape state, branchless
prefill/decode steps that compile with `torch.compile(fullgraph=True)` and export to ExecuTorch
and ONNX.

Importing the package imports neither torch nor transformers: each public name is imported on
first use (PEP 562). Importing the model or its config registers `model_type = "shram"` with
transformers' `AutoConfig` and `AutoModelForCausalLM`.
"""

import importlib as _importlib
import warnings as _warnings

# Supported torch / ExecuTorch, checked before anything imports them: an older release is an
# ImportError naming the supported ones, a newer one a warning (its accelerators stay off).
from .accelerators import check_versions as _check_versions, set_stock, stock  # noqa: F401

for _line in _check_versions():
    _warnings.warn(_line, stacklevel=2)

# public name -> the module that defines it
_LAZY = {
    "ShramConfig": ".config",
    "ShramForCausalLM": ".model", "CausalLMOutput": ".model",
    "ShramCache": ".cache",
    "TextTokenStreamer": ".generation",
    "StaticDecoder": ".decoder",
    "HostDecoder": ".host",
    "StaticState": ".state", "state_bytes": ".state",
    "CapacityError": ".errors", "CheckpointError": ".errors", "NonFiniteLogitsError": ".errors",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shram_static' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [*_LAZY, "set_stock", "stock"]
__version__ = "0.1.0"
