"""Host-side decoding API shared by every backend (eager/compiled torch, ExecuTorch, ONNX).

`HostDecoder` validates input before anything runs (a bad call leaves the state as it was),
keeps each row's live and rollback counts and splits prompts into fixed-size chunks; a backend
implements `_run` (C = 1 or prefill_chunk) and optionally `_run_last`. Its public methods are
the decoder contract (docs/design.md, "The decoder contract"); the loops are in `loops.py`.
"""

import math

import numpy as np
import torch

from .config import ShramConfig
from .errors import CapacityError, NonFiniteLogitsError
from . import loops
from .rows import RowCounts, canonical, last_live, padded_chunks, tokens_per_row
from .validation import SMALL, check_capacity, check_input_ids, check_mask, check_positive_ints

__all__ = ["CapacityError", "HostDecoder"]

FEW_LOGITS = 1024  # logits a step's finiteness check sums in Python (`_check_finite`)


def _check_finite(logits: torch.Tensor, live: torch.Tensor) -> None:
    """Raises NonFiniteLogitsError where a live token's logits hold a NaN or an Inf (WHY:
    sampling them would emit token 0, the argmax of NaN, forever)."""
    if logits.device.type == "cpu":
        # WHY numpy on CPU: torch's isfinite opens an OpenMP parallel region whose workers then
        # spin on the core the next step's runtime (onnxruntime, XNNPACK) needs.
        a = (logits.detach() if logits.requires_grad else logits)
        a = (a if a.dtype == torch.float32 else a.float()).numpy()
        # one sum first (finite exactly when every value is); only a non-finite one is searched.
        # WHY Python's sum of a few logits (in float64): numpy's reduction runs right after the
        # step, its code evicted from the caches, and costs several times as much then
        few = a.size <= FEW_LOGITS and a.flags.c_contiguous
        if math.isfinite(sum(memoryview(a).cast("B").cast("f")) if few else a.sum()):
            return
        fin = torch.from_numpy(np.isfinite(a).all(-1))  # (B, C)
    else:
        fin = torch.isfinite(logits).all(-1).cpu()
    bad = ~fin & live.cpu()  # (B, C)
    if bool(bad.any()):
        rows = sorted({int(r) for r in bad.nonzero()[:, 0]})
        raise NonFiniteLogitsError(
            f"the step produced NaN or Inf logits for rows {rows}: the model's weights (or its "
            f"activations in this dtype) are not finite; nothing was sampled", rows, logits)


class HostDecoder:
    """Public decoding API over a fixed-shape step backend.

    Args:
        config: model config; `inference_sequence_length` is the capacity S per row.
        batch_size: B, rows per call (fixed).
        prefill_chunk: C, tokens per prefill step.
        eos_token_id: id that ends a row in `generate` (None: rows never stop early).
    """

    def __init__(self, config: ShramConfig, batch_size: int, prefill_chunk: int,
                 eos_token_id: int | None = None):
        check_positive_ints(batch_size=batch_size, prefill_chunk=prefill_chunk)
        self.config = config
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.capacity = config.inference_sequence_length
        # WHY a plain attribute: a transformers config's attribute reads run Python hooks (every call reads it)
        self.vocab_size = config.vocab_size
        self.eos_token_id = eos_token_id
        self._counts = RowCounts(batch_size)
        self._all_live = torch.ones(batch_size, dtype=torch.bool)  # (B,) decode's default `active`
        # a backend sets these: tokens a row can forget at once (0: none), the verify step's tokens per
        # row (None: verify runs as prefill), False where prefill returns each row's last logits only
        self.rollback_limit = 0
        self.verify_len: int | None = None
        self.full_logits = True

    # -- backend hooks --------------------------------------------------------------
    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """tokens (B, C) int64, input_pos (B,) int64, live (B, C) bool -> logits (B, C, V)."""
        raise NotImplementedError

    def _run_last(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """`_run` of a prefill chunk, only each row's last live token's logits (B, 1, V)."""
        lg = self._run(tokens, input_pos, live)  # (B, C, V)
        return lg[torch.arange(tokens.shape[0]), last_live(live.cpu()).to(lg.device)][:, None]

    def _reset_state(self) -> None:
        """Optional: clear backend buffers (never needed for correctness)."""

    # -- public API -------------------------------------------------------------------
    @property
    def live_counts(self) -> torch.Tensor:
        """(B,) live tokens each row holds."""
        return self._counts.live.clone()

    def reset(self) -> None:
        """Starts every row afresh (position 0)."""
        self._counts.reset()
        self._reset_state()

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                last_only: bool = False) -> torch.Tensor:
        """Appends tokens to every row and returns their logits.

        Args:
            input_ids: (B, N) token ids, N >= 1 (run as C-token chunks, the last padded).
            attention_mask: (B, N) 1 live / 0 dead (dead tokens are no-ops); default all live.
            last_only: return only each row's logits at its last live token (what generation
                needs, like transformers' `logits_to_keep=1`).

        Returns:
            (B, N, V) float logits (unspecified at dead positions), or (B, V) with `last_only`
            (unspecified for a row without a live token).

        Raises:
            TypeError, ValueError, CapacityError before running anything (state unchanged);
            ValueError without `last_only` where `full_logits` is False.
        """
        if not isinstance(last_only, bool):
            raise TypeError(f"last_only must be a bool, got {type(last_only).__name__}")
        if not last_only:
            self.need_full_logits("prefill(..., last_only=False)")
        ids, live = self.check_prompt(input_ids, attention_mask)
        self._check_capacity(live)
        B, N = ids.shape
        C, V = self.prefill_chunk, self.vocab_size
        ids, live, starts = padded_chunks(ids, live, C)
        out = []
        last = torch.zeros(B, V)  # (B, V) logits at each row's last live token so far
        for c0 in starts:
            lc = live[:, c0:c0 + C]
            if not bool(lc.any()):  # a chunk of padding only changes nothing
                if not last_only:
                    out.append(torch.zeros(B, C, V))
                continue
            lg = self._call(ids[:, c0:c0 + C], lc, last_only).float().cpu()  # (B, C or 1, V)
            if last_only:  # lg (B, 1, V) at each row's last live token in this chunk
                last = torch.where(lc.any(1)[:, None], lg[:, 0], last)
            else:
                out.append(lg)
        return last if last_only else torch.cat(out, dim=1)[:, :N]

    def decode(self, ids: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feeds one token per row.

        Args:
            ids: (B,) token ids.
            active: (B,) bool; inactive rows change nothing (their logits are unspecified).

        Returns:
            (B, V) float logits.
        """
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.shape != (self.batch_size,):
            raise ValueError(f"ids must have shape ({self.batch_size},) (one token per row), got {tuple(ids.shape)}")
        check_input_ids(ids, self.vocab_size, "ids")
        live = check_mask(active, ids.shape, "active")
        live = self._all_live if live is None else live.cpu()
        self._check_capacity(live)
        return self.feed(ids.long().cpu()[:, None], live[:, None])[:, 0]

    # -- rollback and verification (speculative decoding) ----------------------------
    def rollback(self, n) -> None:
        """Forgets the last n tokens of each row, exactly (up to `rollback_limit`, fewer right
        after a rollback).

        Args:
            n: an int (every row) or a (B,) integer tensor / sequence, 0 <= n[b] <= `rollbackable[b]`.

        Raises:
            TypeError, ValueError: a bad n, or more than a row can forget (nothing changed).
        """
        if isinstance(n, bool) or not isinstance(n, (int, torch.Tensor, list, tuple)):
            raise TypeError(f"n must be an int or a (B,) integer tensor, got {type(n).__name__}")
        t = torch.as_tensor(n)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"n must hold integers, got dtype {t.dtype}")
        t = t.long().cpu().expand(self.batch_size) if t.dim() == 0 else t.long().cpu()
        if t.shape != (self.batch_size,):
            raise ValueError(f"n must be an int or have shape ({self.batch_size},), got {tuple(t.shape)}")
        # Python ints: each torch op on a (B,) tensor costs more than the loop over a small B
        want, can = t.tolist(), self.rollbackable.tolist()
        if min(want) < 0:
            raise ValueError(f"n must be >= 0, got {want}")
        b = next((b for b, (w, c) in enumerate(zip(want, can)) if w > c), None)
        if b is not None:
            if not self.rollback_limit:
                why = "this decoder cannot roll back (an export written without rollback support: re-export it)"
            elif can[b] == int(self._counts.live[b]):
                why = f"it holds {int(self._counts.live[b])} tokens"
            else:
                why = (f"it can forget at most {int(can[b])} now (this decoder keeps the last "
                       f"rollback_limit={self.rollback_limit} fed tokens, fewer since a rollback)")
            raise ValueError(f"cannot roll back {int(t[b])} tokens of row {b}: {why}")
        self.forget(t)

    @property
    def rollbackable(self) -> torch.Tensor:
        """(B,) the most tokens each row can forget now (`rollback`)."""
        return self._counts.rollbackable

    def verify(self, ids: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feeds n <= `verify_len` tokens per row in one step and returns their logits (roll
        the rejected tail back with `rollback`); without a verify step they run as `prefill`.

        Args:
            ids: (B, n) token ids.
            active: (B, n) bool, live tokens (default all), appended in column order.

        Returns:
            (B, n, V) float logits (unspecified at dead tokens).

        Raises:
            TypeError, ValueError, CapacityError before running anything (state unchanged);
            ValueError without a verify step where `full_logits` is False.
        """
        n = self.verify_len or self.prefill_chunk
        ids, live = self.check_prompt(ids, active)
        if ids.shape[1] > n:
            raise ValueError(f"verify takes at most {n} tokens per row (verify_len), got {ids.shape[1]}")
        if ids.shape[1] == 1:
            return self.decode(ids[:, 0], live[:, 0])[:, None]
        if self.verify_len is None:
            self.need_full_logits("verify without a verify step (exported without verify_len)")
            return self.prefill(ids, live)
        self._check_capacity(live)
        return self.feed(ids, live)

    # -- the unchecked contract (speculative decoding, generation loops, benchmarks) ----
    def feed(self, ids: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """`decode` (n = 1) or `verify` (1 < n <= verify_len) without the input checks.

        For a loop that feeds back tokens picked from this decoder's own logits within a
        capacity it checked up front. WHY: the checks cost a visible share of a small model's step.

        Args:
            ids: (B, n) int64 token ids in the vocabulary, on the CPU.
            live: (B, n) bool, which tokens are live; every row stays within capacity.

        Returns:
            (B, n, V) float logits (unspecified at dead tokens).
        """
        n = ids.shape[1]
        if 1 < n < self.verify_len:  # the verify step's fixed shape: pad with dead tokens
            ids, live = (torch.nn.functional.pad(t, (0, self.verify_len - n)) for t in (ids, live))
        lg = self._call(ids, live)
        lg = lg if lg.shape[1] == n else lg[:, :n]
        # WHY the checks: `.float().cpu()` of float CPU logits is two dispatched no-ops
        return lg if lg.dtype == torch.float32 and lg.device.type == "cpu" else lg.float().cpu()

    def forget(self, n: torch.Tensor) -> None:
        """`rollback` without its checks: n (B,) int64, each at most `rollbackable`."""
        self._counts.forget(n)

    # -- per-row lifecycle (continuous batching) --------------------------------------
    def reset_rows(self, rows) -> None:
        """Starts the given rows afresh (position 0, nothing cleared); other rows keep their state.

        Args:
            rows: a row index, or a sequence / 1-D integer tensor of them, each in [0, B).

        Raises:
            TypeError, ValueError: a row that is not an int in range (nothing changed).
        """
        idx = torch.as_tensor([rows] if isinstance(rows, int) else rows)
        if idx.dim() != 1 or (idx.numel() and (idx.dtype.is_floating_point or idx.dtype == torch.bool)):
            raise TypeError(f"rows must be an int or a sequence of ints, got {rows!r}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch_size):
            raise ValueError(f"rows must be in [0, {self.batch_size}), got {idx.tolist()}")
        self._counts.reset(idx.long())

    def warm_up(self, kinds=("decode", "prefill_last")) -> None:
        """Runs each kind of step once ahead of use, on dead tokens (no state changes).

        Args:
            kinds: "decode" and/or "prefill_last" (a prompt chunk, last live token's logits).

        Raises:
            ValueError: another kind.
        """
        widths = self._warm_up_widths(kinds)
        B = self.batch_size
        for kind in kinds:
            C = widths[kind]
            self.step(torch.zeros(B, C, dtype=torch.long), torch.zeros(B, C, dtype=torch.bool), last_only=True)

    def _step_widths(self) -> dict[str, int]:
        """Each kind of step this decoder runs -> its tokens per row."""
        return {"decode": 1, "prefill_last": self.prefill_chunk}

    def _warm_up_widths(self, kinds) -> dict[str, int]:
        """`_step_widths`, after refusing any kind of `kinds` it lacks (before anything runs)."""
        widths = self._step_widths()
        bad = [k for k in kinds if k not in widths]
        if bad:
            raise ValueError(f"no {bad[0]!r} step to warm up here: the kinds are {tuple(widths)}")
        return widths

    def step(self, input_ids: torch.Tensor, live: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        """Runs one fixed-shape step (continuous batching): each row advances by its own live tokens.

        Args:
            input_ids: (B, C) token ids, C = 1 or prefill_chunk; any id in the vocabulary at dead tokens.
            live: (B, C) bool / 0-1, which tokens are live, appended in column order.
            last_only: return only each row's logits at its last live token, (B, 1, V).

        Returns:
            (B, C, V) float logits (unspecified at dead tokens), or (B, 1, V) with `last_only`
            (unspecified for a row without a live token).

        Raises:
            TypeError, ValueError, CapacityError before running anything (state unchanged);
            ValueError for a prompt chunk without `last_only` where `full_logits` is False.
        """
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        C = self.prefill_chunk
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size or input_ids.shape[1] not in (1, C):
            raise ValueError(f"input_ids must have shape ({self.batch_size}, 1) or ({self.batch_size}, {C}) "
                             f"(batch_size, 1 or prefill_chunk), got {tuple(input_ids.shape)}")
        check_input_ids(input_ids, self.vocab_size)
        if live is None:
            raise TypeError("live must be a (B, C) bool tensor, got None")
        if not isinstance(last_only, bool):
            raise TypeError(f"last_only must be a bool, got {type(last_only).__name__}")
        if not last_only and input_ids.shape[1] > 1:
            self.need_full_logits("step(...) of a prefill chunk without last_only=True")
        lv = check_mask(live, input_ids.shape, "live").cpu()
        self._check_capacity(lv)
        return self._call(input_ids.long().cpu(), lv, last_only and input_ids.shape[1] > 1).float().cpu()

    generate = loops.generate  # the generation loops (plain, sampled, speculative)

    def _call(self, tokens: torch.Tensor, live: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Runs one checked step, advances the counts (the state holds the tokens), checks the logits."""
        out = (self._run_last if last_only else self._run)(canonical(tokens), self._counts.live, canonical(live))
        self._counts.fed(live, self.rollback_limit)
        _check_finite(out, live.any(1, keepdim=True) if last_only else live)
        return out

    # -- validation -----------------------------------------------------------------
    def need_full_logits(self, what: str) -> None:
        if not self.full_logits:
            raise ValueError(f"{what} needs every token's logits, but this export's prefill step returns "
                             f"only each row's last token's: re-export with full_logits=True "
                             f"(shram-static export --full-logits)")

    def check_prompt(self, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] != self.batch_size:
            raise ValueError(f"this decoder was built for batch_size={self.batch_size}, got "
                             f"{input_ids.shape[0]} rows")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: a prompt needs at least one token")
        check_input_ids(input_ids, self.vocab_size)
        live = check_mask(attention_mask, input_ids.shape)
        live = torch.ones(input_ids.shape, dtype=torch.bool) if live is None else live.cpu()
        return input_ids.long().cpu(), live

    def _check_capacity(self, live: torch.Tensor) -> None:
        """Raises CapacityError if a row would hold more than the capacity after the live tokens
        of live, a (B,) or (B, C) bool mask."""
        # WHY Python ints first: a few values need no dispatched torch op (`validation.SMALL`)
        if live.numel() <= SMALL:
            if max(map(int.__add__, self._counts.live.tolist(), tokens_per_row(live))) <= self.capacity:
                return
        n_new = live.long() if live.dim() == 1 else live.long().sum(1)
        check_capacity(self._counts.live + n_new, self.capacity,
                       advice="call reset() or build the model with a larger inference_sequence_length")
