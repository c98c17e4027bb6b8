"""Fixed-shape decoding state (SPEC B): every buffer allocated once, before any step runs.

Per layer:
- `taken (B, L)` bool: experts taken in the routing block that is open; a step reads it as
  all False when the row's live count is a multiple of W, so it never needs clearing.
- `local_k`, `local_v` `(B*H*(R+1), u)`: the local ring of R = window + prefill_chunk - 1
  slots per (row, head) plus one write sink. Slot j holds the latest live position
  q <= count-1 with q % R == j. R leaves room for a whole chunk: writing a chunk never
  overwrites a key that a query of the same chunk still needs, so a step writes first and
  then attends over the ring alone (decode and prefill are one code path).
- `sparse_k`, `sparse_v` `(B*L*(T+1), u)` with T = mosrah_cache_length: per (row, expert)
  the keys (after RoPE) / values of the tokens routed there, in order, plus one write sink.
  Expert l of row b holds `count // W + taken[l]` tokens, so no count buffer is needed.

Caches are stored flat (2-D) so each write is `index_put_` with ONE 1-D row index: the only
form that stays in place and runs on every backend (ExecuTorch's in-place index_put rejects
multi-dimensional indices; writing through a reshaped view adds a whole-buffer write-back).

The live count per row is not state: every step takes it as `input_pos`, so position 0
starts a fresh sequence without clearing any buffer (stale slots are masked out), as the
ExecuTorch runner expects.
"""

import torch
from torch import nn

from .config import ShramConfig

LAYER_BUFFERS = ("taken", "local_k", "local_v", "sparse_k", "sparse_v")


class LayerState(nn.Module):
    def __init__(self, config: ShramConfig, batch_size: int, ring: int, dtype: torch.dtype):
        super().__init__()
        B, H, L, u = batch_size, config.num_sliding_window_heads, config.num_mosrah_heads, config.head_dim
        T = config.mosrah_cache_length
        # Zeros, not empty: a masked slot holding NaN would still poison attention (0 * NaN).
        self.register_buffer("taken", torch.zeros(B, L, dtype=torch.bool))
        self.register_buffer("local_k", torch.zeros(B * H * (ring + 1), u, dtype=dtype))
        self.register_buffer("local_v", torch.zeros(B * H * (ring + 1), u, dtype=dtype))
        self.register_buffer("sparse_k", torch.zeros(B * L * (T + 1), u, dtype=dtype))
        self.register_buffer("sparse_v", torch.zeros(B * L * (T + 1), u, dtype=dtype))


class StaticState(nn.Module):
    """All decoding state of one batch, allocated once.

    Args:
        config: model config.
        batch_size: B rows.
        prefill_chunk: C, the most tokens one step takes per row.
        dtype: cache dtype (the model's).
        device: where to allocate.
    """

    def __init__(self, config: ShramConfig, batch_size: int, prefill_chunk: int,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.ring = config.window_size + prefill_chunk - 1  # R
        self.sparse_len = config.mosrah_cache_length  # T
        self.layers = nn.ModuleList(LayerState(config, batch_size, self.ring, dtype)
                                    for _ in range(config.num_decoder_layers))
        if device is not None:
            self.to(device)

    def names(self) -> list[str]:
        """Buffer names in the fixed order used by functional steps and exported graphs."""
        return [name for name, _ in self.named_buffers()]

    def tensors(self) -> list[torch.Tensor]:
        return [b for _, b in self.named_buffers()]

    def nbytes(self) -> int:
        """Total bytes of state; equals `state_bytes(...)`."""
        return sum(b.numel() * b.element_size() for b in self.tensors())

    @torch.no_grad()
    def reorder_(self, beam_idx: torch.Tensor) -> None:
        """Row b of every buffer becomes the old row `beam_idx[b]`, in place (beam search).

        Every buffer is stored batch-major, so a `(B, -1)` view of it has one row per sequence.
        """
        idx = beam_idx.to(device=self.layers[0].taken.device, dtype=torch.long)
        for b in self.tensors():
            rows = b.view(self.batch_size, -1)
            rows.copy_(rows.index_select(0, idx))

    @torch.no_grad()
    def zero_(self) -> None:
        """Clears every buffer (not needed for correctness; used by tests and reset)."""
        for b in self.tensors():
            b.zero_()


def state_bytes(config: ShramConfig, batch_size: int, prefill_chunk: int, itemsize: int = 4) -> int:
    """Closed-form state size (SPEC B): per layer B*L bools, a local ring
    2*B*H*(window+C)*u and a sparse cache 2*B*L*(mosrah_cache_length+1)*u elements."""
    B, H, L, u = batch_size, config.num_sliding_window_heads, config.num_mosrah_heads, config.head_dim
    R1 = config.window_size + prefill_chunk
    T1 = config.mosrah_cache_length + 1
    per_layer = B * L + itemsize * (2 * B * H * R1 * u + 2 * B * L * T1 * u)
    return config.num_decoder_layers * per_layer
