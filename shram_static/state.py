"""Fixed-shape decoding state (docs/design.md, "The static state"): every buffer allocated once, before any step runs.

Per layer, with Nr the rollback limit (`rollback_limit`, at least prefill_chunk):
- `routes` `(B*(N+1), K)` int64, N = Nr + W - 1 (W = L // K tokens per routing block): the
  routing history. Row `b*(N+1) + q % N` holds the K experts position q selected (dead tokens
  write the row's sink, row N). A step derives the experts taken in the open block at
  input_pos p from rows p - p % W .. p - 1, all written by the current sequence (N >= W), so a
  restart at position 0 needs no clearing.
- `local_k`, `local_v` `(B*H*(R+1), u)`: the local ring of R = window + Nr - 1 slots per
  (row, head) plus one write sink. Slot j holds the latest live position q <= count-1 with
  q % R == j. R leaves room for a whole chunk: writing a chunk never overwrites a key that a
  query of the same chunk still needs, so a step writes first and then attends over the ring
  alone (decode and prefill are one code path).
- `sparse_k`, `sparse_v` `(B*L*(T+1), u)` with T = mosrah_cache_length: per (row, expert)
  the keys (after RoPE) / values of the tokens routed there, in order, plus one write sink.
  Expert l of row b holds `count // W + taken[l]` tokens, so no count buffer is needed.

Rollback (forgetting the last n tokens of a row) is `count -= n` on the host and nothing
else, exact while n does not exceed what the row can undo (see `HostDecoder.rollback`):
- the ring keeps the last R positions fed; after forgetting n <= Nr of them the window of
  every later query (window - 1 keys back) is still there, and a slot holding a forgotten
  position x claims position x - R, outside every later query's window;
- the history keeps the last N routing rows: the open block's W - 1 rows survive n <= Nr;
- a forgotten token's sparse slots lie past `count // W + taken` of its experts: masked,
  then overwritten.

Caches are stored flat (2-D) so each write is `index_put_` with ONE 1-D row index: the only
form that stays in place and runs on every backend (ExecuTorch's in-place index_put rejects
multi-dimensional indices; writing through a reshaped view adds a whole-buffer write-back).

The live count per row is not state: every step takes it as `input_pos`, so position 0
starts a fresh sequence without clearing any buffer (stale slots are masked out), as the
ExecuTorch runner expects.
"""

import bisect

import torch
from torch import nn

from .config import ShramConfig

def write_rows(buf: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, inplace: bool) -> torch.Tensor:
    """`buf` with rows `rows` (1-D) set to `vals`: written in place (`inplace`), else a new tensor."""
    if inplace:
        return buf.index_put_((rows,), vals)
    return buf.index_put((rows,), vals)


def rollback_sizes(config: ShramConfig, prefill_chunk: int, rollback_limit: int | None = None) -> tuple[int, int, int]:
    """(Nr, R, N): the rollback limit, ring slots and routing-history rows of a state.

    Args:
        config: model config.
        prefill_chunk: C, the most tokens one step takes per row.
        rollback_limit: tokens a row can forget at once; None or anything below C gives C (the
            ring holds a whole chunk anyway).
    """
    if rollback_limit is not None and (isinstance(rollback_limit, bool) or not isinstance(rollback_limit, int)
                                       or rollback_limit < 0):
        raise ValueError(f"rollback_limit must be a non-negative int or None, got {rollback_limit!r}")
    Nr = max(prefill_chunk, rollback_limit or 0)
    return Nr, config.window_size + Nr - 1, Nr + config.block_length - 1


# The shortest prefix of the sparse caches a step attends (`prefix_lengths`).
MIN_PREFIX = 64


def prefix_lengths(config: ShramConfig, spacing: int | None = None) -> tuple[int, ...]:
    """The prefix lengths a step may attend of each expert's cache (T + 1 slots, the sink
    last), then the whole cache: a step over P slots costs about P/(T+1) of the whole
    capacity's sparse attention (docs/design.md, "Prefix lengths").

    Args:
        config: the model config (`mosrah_cache_length` T).
        spacing: None: powers of two from MIN_PREFIX while at most half the cache (an exported
            program's methods, one per length), the last the whole cache, T + 1; else the
            multiples of `spacing` below T, then T (the compiled steps: one graph for every
            length, where P = T + 1, the whole dim, would be a graph of its own; no live slot
            is ever past T - 1).

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
    """The shortest of `lengths` that holds every live slot of a row with `counts_after` live
    tokens after the step (the largest count of the batch): an expert holds at most
    ceil(count / W) tokens, at slots 0 .. ceil(count / W) - 1.

    Args:
        lengths: `prefix_lengths(config)`; block_length: W = L / K;
        counts_after: the most live tokens a row holds once the step has run.

    Returns:
        a length of `lengths` (the last, the whole cache, when none shorter holds them).
    """
    i = bisect.bisect_left(lengths, -(-counts_after // block_length))
    return lengths[min(i, len(lengths) - 1)]


def slot_numbers(T: int, device=None) -> torch.Tensor:
    """(T + 1,) float32: the number of each slot of an expert's cache, arange(T), then 2**24 at
    the sink (past every slot: never attended). A step attends the first P (`step`'s slots)."""
    ar = torch.arange(T + 1, device=device)
    return torch.where(ar < T, ar, 2 ** 24).float()


class PrefixSlots:
    """What a step is fed as its `slots` input: the numbers of the shortest prefix of `lengths`
    that holds every row's live slots after the step (`prefix_len`); `StaticDecoder` and the
    `.pte` / `.onnx` runners alike.

    Args:
        cfg: the model config.
        lengths: the prefix lengths (`prefix_lengths`; an export's, from its metadata).
        device: where the slot numbers live.
    """

    def __init__(self, cfg: ShramConfig, lengths, device=None):
        self.lengths = tuple(lengths)
        self.block = cfg.block_length
        self.table = slot_numbers(cfg.mosrah_cache_length, device)[:self.lengths[-1]].contiguous()

    def __call__(self, input_pos: torch.Tensor, chunk: int) -> torch.Tensor:
        """(P,) float32 slot numbers for a step of `chunk` tokens per row at `input_pos` (B,)."""
        return self.table[:prefix_len(self.lengths, self.block, int(input_pos.max()) + chunk)]


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
        rollback_limit: Nr, the most tokens a row can forget at once (`rollback_sizes`;
            default and minimum C). Larger limits grow the ring to window + Nr - 1 slots.
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
        """Row b of every buffer becomes the old row `beam_idx[b]`, in place (beam search).

        Every buffer is stored batch-major, so a `(B, -1)` view of it has one row per sequence.
        """
        idx = beam_idx.to(device=self.layers[0].routes.device, dtype=torch.long)
        for b in self.tensors():
            rows = b.view(self.batch_size, -1)
            rows.copy_(rows.index_select(0, idx))

    @torch.no_grad()
    def zero_(self) -> None:
        """Clears every buffer (not needed for correctness; used by tests and reset)."""
        for b in self.tensors():
            b.zero_()


def state_bytes(config: ShramConfig, batch_size: int, prefill_chunk: int, itemsize: int = 4,
                rollback_limit: int | None = None) -> int:
    """Closed-form state size (docs/design.md, "The static state"): per layer a routing history of B*(N+1)*K int64
    (N = Nr + W - 1), a local ring 2*B*H*(window+Nr)*u and a sparse cache
    2*B*L*(mosrah_cache_length+1)*u elements, Nr = max(prefill_chunk, rollback_limit)."""
    B, H, L, u = batch_size, config.num_sliding_window_heads, config.num_mosrah_heads, config.head_dim
    _, R, N = rollback_sizes(config, prefill_chunk, rollback_limit)
    T1 = config.mosrah_cache_length + 1
    per_layer = 8 * B * (N + 1) * config.num_selected_heads + itemsize * (2 * B * H * (R + 1) * u + 2 * B * L * T1 * u)
    return config.num_decoder_layers * per_layer
