"""Fixed-shape decoding state: every buffer allocated once, before any step runs.

Per layer, with Nr the rollback limit (at least prefill_chunk): the routing history `routes`
(B*(N+1), K) int64, N = Nr + W - 1; the local ring `local_k`, `local_v` (B*H*(R+1), u),
R = window + Nr - 1; the expert caches `sparse_k`, `sparse_v` (B*L*(T+1), u). Each has write
sinks no query reads and is flat, so every write is `index_put_` with one 1-D row index. The live
count is not state: every step takes it as `input_pos`. See docs/design.md, "The static state".
"""

import bisect

import torch
from torch import nn

from .config import ShramConfig

def write_rows(buf: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, inplace: bool) -> torch.Tensor:
    """`buf` with rows `rows` (1-D) set to `vals`: written in place (`inplace`), else a new tensor."""
    return buf.index_put_((rows,), vals) if inplace else buf.index_put((rows,), vals)


def rollback_sizes(config: ShramConfig, prefill_chunk: int, rollback_limit: int | None = None) -> tuple[int, int, int]:
    """(Nr, R, N): the rollback limit (at least prefill_chunk), ring slots and routing-history rows."""
    if rollback_limit is not None and (isinstance(rollback_limit, bool) or not isinstance(rollback_limit, int)
                                       or rollback_limit < 0):
        raise ValueError(f"rollback_limit must be a non-negative int or None, got {rollback_limit!r}")
    Nr = max(prefill_chunk, rollback_limit or 0)
    return Nr, config.window_size + Nr - 1, Nr + config.block_length - 1


MIN_PREFIX = 64  # the shortest prefix of the sparse caches a step attends (`prefix_lengths`)


def prefix_lengths(config: ShramConfig, spacing: int | None = None) -> tuple[int, ...]:
    """The prefix lengths a step may attend of each expert's cache (docs/design.md, "Prefix lengths").

    Args:
        config: the model config (`mosrah_cache_length` T).
        spacing: None: powers of two from MIN_PREFIX up to half the cache, then T + 1 (exported
            programs); else the multiples of `spacing` below T, then T (compiled steps).

    Returns:
        the lengths, ascending.
    """
    T1 = config.mosrah_cache_length + 1
    if spacing is not None:
        return (*range(spacing, T1 - 1, spacing), T1 - 1)
    out, p = [], MIN_PREFIX
    while 2 * p <= T1:
        out.append(p)
        p *= 2
    return (*out, T1)


def prefix_len(lengths: tuple[int, ...], block_length: int, counts_after: int) -> int:
    """The shortest of `lengths` that holds every live slot (an expert holds at most
    ceil(count / W) tokens).

    Args:
        lengths: `prefix_lengths(config)`; block_length: W = L / K;
        counts_after: the most live tokens a row holds once the step has run.

    Returns:
        a length of `lengths` (the last, the whole cache, when none shorter holds them).
    """
    i = bisect.bisect_left(lengths, -(-counts_after // block_length))
    return lengths[min(i, len(lengths) - 1)]


def slot_numbers(T: int, device=None) -> torch.Tensor:
    """(T + 1,) float32 slot numbers of an expert's cache: arange(T), then 2**24 at the sink."""
    ar = torch.arange(T + 1, device=device)
    return torch.where(ar < T, ar, 2 ** 24).float()


class PrefixSlots:
    """A step's `slots` input: the numbers of the shortest prefix of `lengths` that holds every
    row's live slots after the step (`prefix_len`).

    Args:
        cfg: the model config.
        lengths: the prefix lengths (`prefix_lengths`; an export's, from its metadata).
        device: where the slot numbers live.
    """

    def __init__(self, cfg: ShramConfig, lengths, device=None):
        self.lengths = tuple(lengths)
        self.block = cfg.block_length
        table = slot_numbers(cfg.mosrah_cache_length, device)[:self.lengths[-1]].contiguous()
        # WHY every prefix made once: a slice per step is a dispatched op (microseconds right after a step)
        self.prefixes = {P: table[:P] for P in self.lengths}

    def __call__(self, input_pos: torch.Tensor, chunk: int) -> torch.Tensor:
        """(P,) float32 slot numbers for a step of `chunk` tokens per row at `input_pos` (B,)."""
        return self.prefixes[prefix_len(self.lengths, self.block, max(input_pos.tolist()) + chunk)]


class LayerState(nn.Module):
    def __init__(self, config: ShramConfig, batch_size: int, ring: int, dtype: torch.dtype, history: int = 1):
        super().__init__()
        B, H, L, u = batch_size, config.num_sliding_window_heads, config.num_mosrah_heads, config.head_dim
        T, K = config.mosrah_cache_length, config.num_selected_heads
        # Zeros, not empty: a masked slot holding NaN would still poison attention (0 * NaN).
        self.register_buffer("routes", torch.zeros(B * (history + 1), K, dtype=torch.long))
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
        rollback_limit: Nr, the most tokens a row can forget at once (default and minimum C).
    """

    def __init__(self, config: ShramConfig, batch_size: int, prefill_chunk: int,
                 dtype: torch.dtype = torch.float32, device=None, rollback_limit: int | None = None):
        super().__init__()
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.rollback_limit, self.ring, self.history = rollback_sizes(config, prefill_chunk, rollback_limit)  # Nr, R, N
        self.sparse_len = config.mosrah_cache_length  # T
        self.layers = nn.ModuleList(LayerState(config, batch_size, self.ring, dtype, self.history)
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
        """Row b of every buffer becomes the old row `beam_idx[b]`, in place (beam search)."""
        idx = beam_idx.to(device=self.layers[0].routes.device, dtype=torch.long)
        for b in self.tensors():
            rows = b.view(self.batch_size, -1)  # batch-major: one row per sequence
            rows.copy_(rows.index_select(0, idx))

    @torch.no_grad()
    def zero_(self) -> None:
        """Clears every buffer (not needed for correctness; used by tests and reset)."""
        for b in self.tensors():
            b.zero_()


def state_bytes(config: ShramConfig, batch_size: int, prefill_chunk: int, itemsize: int = 4,
                rollback_limit: int | None = None) -> int:
    """Closed-form state size in bytes (docs/design.md, "The static state"); itemsize: bytes
    per cache element, rollback_limit: as in `StaticState`."""
    B, H, L, u = batch_size, config.num_sliding_window_heads, config.num_mosrah_heads, config.head_dim
    _, R, N = rollback_sizes(config, prefill_chunk, rollback_limit)
    T1 = config.mosrah_cache_length + 1
    per_layer = 8 * B * (N + 1) * config.num_selected_heads + itemsize * (2 * B * H * (R + 1) * u + 2 * B * L * T1 * u)
    return config.num_decoder_layers * per_layer
