"""`ShramCache`: the fixed-shape SHRAM state (`StaticState`) as a `transformers.Cache`.

It implements the part of transformers' (5.x) cache protocol `generate()` uses:
`get_seq_length()`, `is_compileable`, `reorder_cache` (beam search) and `crop` (assisted and
prompt-lookup decoding). The layers are thin views on `StaticState.layers`; all writing happens
in `ShramCache.run`, the one place that calls the step. Its counters are tensors: Python ints
on the cache would be guarded by `torch.compile` and recompile the decode forward every step.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import ShramConfig
from .rows import RowCounts, padded_chunks
from .state import StaticState
from .step import step

DEFAULT_PREFILL_CHUNK = 32


class ShramCacheLayer(CacheLayerMixin):
    """One decoder layer's part of a `ShramCache`: transformers expects one per layer, but the
    static step writes the whole state at once (`update` raises)."""

    is_compileable = True
    is_croppable = True  # exact, up to the cache's rollback_limit (ShramCache.crop)

    def __init__(self, cache: "ShramCache", index: int):
        super().__init__()
        self._cache = cache
        self.index = index
        self.batch_size = cache.state.batch_size
        self.buffers = cache.state.layers[index]  # LayerState: routes, local_k/v, sparse_k/v
        self.is_initialized = True  # allocated up front, never lazily

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to do: the state is allocated when the cache is built."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("SHRAM cache layers are written by the static step "
                                  "(ShramCache.run), not through Cache.update")

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return self._cache.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def reset(self) -> None:
        """The whole state is reset by `ShramCache.reset`."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """The whole state is reordered by `ShramCache.reorder_cache`."""


class ShramCache(Cache):
    """Fixed-shape decoding state for `ShramForCausalLM.generate` (and direct forward calls).

    Args:
        config: the model's `ShramConfig` (`inference_sequence_length`: live tokens per row).
        batch_size: B rows (beam search: batch times max(num_beams, num_return_sequences)).
        prefill_chunk: C, tokens per prefill step (longer inputs run as padded C-token chunks).
        dtype, device: of the state; use the model's.
        rollback_limit: the most tokens `crop` can remove at once (default and minimum C).

    With `model.generate(..., cache=cache)` the state carries across calls: the next call's
    `input_ids` and mask must cover the whole sequence so far, as for any transformers cache.
    """

    def __init__(self, config: ShramConfig, batch_size: int = 1, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 dtype: torch.dtype = torch.float32, device=None, rollback_limit: int | None = None):
        if not isinstance(config, ShramConfig):
            raise TypeError(f"config must be a ShramConfig, got {type(config).__name__}")
        for name, v in (("batch_size", batch_size), ("prefill_chunk", prefill_chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.config = config
        self.state = StaticState(config, batch_size, prefill_chunk, dtype=dtype, device=device,
                                 rollback_limit=rollback_limit)
        dev = self.state.layers[0].routes.device
        self.counts = RowCounts(batch_size, dev)
        # padded columns consumed (`get_seq_length`): dead ones count, as generate() slices by it
        self.columns = torch.zeros((), dtype=torch.long, device=dev)
        super().__init__(layers=[ShramCacheLayer(self, i) for i in range(config.num_decoder_layers)])

    # -- properties -------------------------------------------------------------------
    @property
    def live_counts(self) -> torch.Tensor:
        """(B,) live tokens each row holds (the tensor the steps read, updated in place)."""
        return self.counts.live

    @property
    def undo(self) -> torch.Tensor:
        """(B,) tokens each row can forget now (`crop`), at most `rollback_limit`."""
        return self.counts.undo

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    @property
    def prefill_chunk(self) -> int:
        return self.state.prefill_chunk

    @property
    def rollback_limit(self) -> int:
        """The most tokens `crop` can remove at once."""
        return self.state.rollback_limit

    @property
    def capacity(self) -> int:
        """Live tokens a row can hold (`inference_sequence_length`)."""
        return self.config.inference_sequence_length

    @property
    def dtype(self) -> torch.dtype:
        return self.state.layers[0].local_k.dtype

    @property
    def device(self) -> torch.device:
        return self.live_counts.device

    # -- the transformers Cache protocol ----------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of `input_ids` consumed so far (dead padding columns included)."""
        return int(self.columns)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def reset(self) -> None:
        """Empties every row (and zeroes the buffers)."""
        self.state.zero_()
        self.counts.reset()
        self.columns.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b takes the state of row `beam_idx[b]`, in place (beam search)."""
        idx = beam_idx.to(device=self.device, dtype=torch.long)
        self.state.reorder_(idx)
        self.counts.reorder(idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Forgets the last `-tokens_to_remove` columns of every row, exactly (transformers 5.x:
        a negative count); the columns must be live tokens of every row.

        Raises:
            TypeError, ValueError: not an int, a positive count, or more than a row can forget
                now; nothing changed.
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"tokens_to_remove must be an int, got {type(tokens_to_remove).__name__}")
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove} "
                             f"(the absolute-length form is not supported)")
        n = -tokens_to_remove
        if n == 0:
            return
        can = self.counts.rollbackable.min().item()
        if n > can or n > int(self.columns):
            raise ValueError(f"cannot crop {n} tokens: a row can forget at most {can} now (this cache keeps "
                             f"the last rollback_limit={self.rollback_limit} fed tokens, fewer since a crop)")
        self.counts.forget(n)
        self.columns.sub_(n)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("a ShramCache has a fixed batch size; build one with the batch size you need")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("a ShramCache has a fixed batch size; build one with the batch size you need")

    # -- running the static step --------------------------------------------------------
    def run(self, model, ids: torch.Tensor, live: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Appends N columns to every row (N = 1: a decode step; else C-column prefill steps) and
        returns their logits. No validation or host read-back: it runs inside the compiled forward.

        Args:
            model: the `ShramForCausalLM` whose dtype and device this cache has.
            ids: (B, N) int64 token ids.
            live: (B, N) bool, False at dead (padding) columns.
            keep: 0, or return only the last `keep` columns' logits (chunks before them keep none).

        Returns:
            (B, N or keep, V) logits (unspecified at dead columns).
        """
        B, N = ids.shape
        if N == 1:
            logits = self._step(model, ids, live)
        else:
            C = self.prefill_chunk
            ids, live, starts = padded_chunks(ids, live, C)
            first = 0 if not keep else max(N - keep, 0) // C * C  # first chunk whose logits are kept
            chunks = []
            for c0 in starts:
                lc = live[:, c0:c0 + C]
                if not torch.compiler.is_compiling() and not bool(lc.any()):
                    # a chunk of padding only is a no-op (skipped eagerly: the check reads back)
                    if c0 >= first:
                        chunks.append(torch.zeros(B, C, model.config.vocab_size, dtype=self.dtype,
                                                  device=self.device))
                    continue
                # a chunk whose logits are dropped runs the lm_head for one token per row only
                lg = self._step(model, ids[:, c0:c0 + C], lc, last_only=c0 < first)
                if c0 >= first:
                    chunks.append(lg)
            logits = torch.cat(chunks, dim=1)[:, :N - first]
        self.columns.add_(N)
        return logits[:, -keep:] if keep else logits

    def _step(self, model, tokens: torch.Tensor, live: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        logits, _ = step(model=model, state=self.state.tensors(), tokens=tokens, input_pos=self.live_counts,
                            live=live, ring=self.state.ring, inplace=True, last_only=last_only)
        self.counts.fed(live, self.state.rollback_limit)
        return logits
