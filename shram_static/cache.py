"""`ShramCache`: the fixed-shape SHRAM state (`StaticState`) as a `transformers.Cache`.

`generate()` talks to a cache through a small protocol (transformers 5.x): `get_seq_length()`
(it slices `input_ids` and the attention mask by it), `is_compileable` (auto-compile of the
decode forward), `reorder_cache(beam_idx)` (beam search), and `crop` / `is_croppable` in
assisted and prompt-lookup decoding (forgetting rejected tokens: `HostDecoder.rollback`).
SHRAM's state is not head-shaped key/value tensors that grow by one column per token: each
decoder layer holds a local ring and per-expert sparse caches (see `state.py`), written by the
static step (`step.py`). So the layers here are thin views on `StaticState.layers`, and all
writing happens in `ShramCache.run`, the one place that calls the step.

Its counters are tensors: Python ints stored on the cache would be guarded by `torch.compile`
and recompile the decode forward at every step.
- `live_counts (B,)`, `undo (B,)`: live tokens each row holds (the step's `input_pos`) and
  tokens it can forget now (`crop`), kept by `rows.RowCounts` as `HostDecoder`'s are.
- `columns ()`: padded columns consumed, what `get_seq_length()` reports; a dead (left-pad)
  column counts, because `generate()` slices the padded `input_ids` and mask by it.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import ShramConfig
from .rows import RowCounts, padded_chunks
from .state import StaticState
from .step import step

DEFAULT_PREFILL_CHUNK = 32


class ShramCacheLayer(CacheLayerMixin):
    """One decoder layer's part of a `ShramCache` (its `LayerState` buffers).

    The layer never takes key/value updates (`update` raises): the static step writes the
    whole state at once. It exists so the `Cache` has one layer per decoder layer, as
    transformers expects.
    """

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
        config: the model's `ShramConfig`; `inference_sequence_length` is the capacity
            (live tokens per row).
        batch_size: B rows (for beam search / several return sequences: batch times
            max(num_beams, num_return_sequences)).
        prefill_chunk: C, tokens per prefill step; a longer input runs as several chunks of
            exactly C (the last padded with dead tokens), so every prefill step has one shape.
        dtype, device: of the state; use the model's (`model.dtype`, `model.device`).
        rollback_limit: the most tokens `crop` can remove at once (default and minimum
            prefill_chunk; assisted decoding removes up to its number of draft tokens).

    Pass it as `model.generate(..., cache=cache)` to keep the state across calls: the next
    call's `input_ids` must then be the whole sequence so far (earlier prompt and outputs
    included, e.g. the previous call's output plus new tokens) and its attention mask must
    cover all of it, as for any transformers cache.
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
        self.columns = torch.zeros((), dtype=torch.long, device=dev)  # ()
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
        """Empties every row (the buffers are zeroed too, though position 0 alone would do)."""
        self.state.zero_()
        self.counts.reset()
        self.columns.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b takes the state of row `beam_idx[b]`, in place (beam search)."""
        idx = beam_idx.to(device=self.device, dtype=torch.long)
        self.state.reorder_(idx)
        self.counts.reorder(idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Forgets the last `-tokens_to_remove` columns of every row, exactly (transformers 5.x
        semantics: a negative count; 0 is a no-op). The columns must be live tokens of every
        row (what assisted decoding appends).

        Raises:
            ValueError: a positive count, or more than a row can forget (`rollback_limit`,
                fewer right after a crop); nothing changed.
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
        """Appends N columns to every row and returns their logits.

        N = 1 is one decode step; longer inputs run as ceil(N / C) prefill steps of exactly C
        columns. No validation and no host read-back here (it runs inside the compiled decode
        forward): `ShramForCausalLM.forward` validates eager calls, `generate` checks capacity
        up front.

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
                    # A chunk of padding only is a no-op: skip its compute (eager only, as the
                    # check reads a value back to the host).
                    if c0 >= first:
                        chunks.append(torch.zeros(B, C, model.config.vocab_size, dtype=self.dtype,
                                                  device=self.device))
                    continue
                # a chunk whose logits are dropped runs the lm_head for one token per row only
                lg = self._step(model, ids[:, c0:c0 + C], lc, last_only=c0 < first)
                if c0 >= first:
                    chunks.append(lg)
            logits = torch.cat(chunks, dim=1)[:, :N - first]
        if keep:
            logits = logits[:, -keep:]
        self.columns.add_(N)
        return logits

    def _step(self, model, tokens: torch.Tensor, live: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        logits, _ = step(model=model, state=self.state.tensors(), tokens=tokens, input_pos=self.live_counts,
                            live=live, ring=self.state.ring, inplace=True, last_only=last_only)
        self.counts.fed(live.long().sum(1), self.state.rollback_limit)
        return logits
