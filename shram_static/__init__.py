"""shram_static: SHRAM language models from static graphs.

Fixed-shape state, branchless prefill/decode steps that compile with
`torch.compile(fullgraph=True)` and export to ExecuTorch and ONNX.
"""

from .config import ShramConfig
from .decoder import StaticDecoder
from .host import CapacityError, HostDecoder
from .model import CausalLMOutput, ShramForCausalLM
from .checkpoint import CheckpointError
from .state import StaticState, state_bytes

__all__ = ["ShramConfig", "ShramForCausalLM", "CausalLMOutput", "StaticDecoder", "HostDecoder",
           "StaticState", "state_bytes", "CapacityError", "CheckpointError"]
__version__ = "0.1.0"
