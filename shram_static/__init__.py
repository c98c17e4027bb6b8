"""shram_static: SHRAM language models from static graphs.

Fixed-shape state, branchless prefill/decode steps that compile with
`torch.compile(fullgraph=True)` and export to ExecuTorch and ONNX.
"""

import warnings as _warnings

# Supported torch / ExecuTorch, checked before anything imports them: an older release is an
# ImportError naming the supported ones, a newer one a warning (its accelerators stay off).
from .accelerators import check_versions as _check_versions, set_stock, stock  # noqa: F401

for _line in _check_versions():
    _warnings.warn(_line, stacklevel=2)

from .console import quiet_loggers  # noqa: E402

# WHY quiet: importing transformers' model classes imports torchao (its quantizer registry),
# which on a CPU-only torch logs a warning for each CUDA kernel library it cannot load, and
# registers Enums that torch 2.13 logs as deprecated: four warnings before any output of ours,
# about nothing this package uses. Only records of those two loggers during these imports are
# dropped.
with quiet_loggers("torchao", "torch.utils._pytree"):
    from transformers import AutoConfig, AutoModelForCausalLM

    from .config import ShramConfig
    from .decoder import StaticDecoder
    from .errors import CapacityError, CheckpointError, NonFiniteLogitsError
    from .host import HostDecoder
    from .model import CausalLMOutput, ShramForCausalLM
    from .cache import ShramCache
    from .generation import TextTokenStreamer
    from .state import StaticState, state_bytes

# Auto classes: `AutoConfig/AutoModelForCausalLM.from_pretrained(dir)` load a SHRAM checkpoint
# (also one written by the original code, whose `auto_map` points at remote code) into this
# package, without trust_remote_code. exist_ok: re-importing (e.g. importlib.reload) is fine.
AutoConfig.register(ShramConfig.model_type, ShramConfig, exist_ok=True)
AutoModelForCausalLM.register(ShramConfig, ShramForCausalLM, exist_ok=True)

__all__ = ["ShramConfig", "ShramForCausalLM", "CausalLMOutput", "ShramCache", "TextTokenStreamer",
           "StaticDecoder", "HostDecoder", "StaticState", "state_bytes", "CapacityError", "CheckpointError",
           "NonFiniteLogitsError", "set_stock", "stock"]
__version__ = "0.1.0"
