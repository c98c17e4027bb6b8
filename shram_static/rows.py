"""Per-row bookkeeping around a step, shared by `HostDecoder` and `ShramCache`."""

import torch
import torch.nn.functional as F

from .validation import SMALL


class RowCounts:
    """The live-token and rollback counts of B rows, (B,) int64 tensors updated in place (so a
    compiled forward that reads them never recompiles).

    Args:
        batch_size: B.
        device: of the counts (the state's).

    Attributes:
        live: (B,) live tokens each row holds.
        undo: (B,) tokens each row can forget now, at most the rollback limit given to `fed`.
    """

    def __init__(self, batch_size: int, device=None):
        self.live = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.undo = torch.zeros(batch_size, dtype=torch.long, device=device)
        # numpy views of CPU counts (the same memory) for `fed` and `forget`
        self._np = (self.live.numpy(), self.undo.numpy()) if self.live.device.type == "cpu" else None

    def fed(self, live: torch.Tensor, rollback_limit: int) -> None:
        """Rows took the live tokens of live (B, C) bool; one can be forgotten until
        rollback_limit more were fed."""
        # (traced by Dynamo where a compiled forward runs a `ShramCache`: torch ops only)
        if (self._np is None or live.device.type != "cpu" or live.numel() > SMALL
                or torch.compiler.is_compiling()):
            n = live.sum(1)
            self.live.add_(n)
            self.undo.add_(n).clamp_(max=rollback_limit)
            return
        # WHY Python ints for a few rows: the torch ops above cost microseconds each right after
        # a step (it evicted the host code's caches); `tolist` and numpy items need no dispatch
        lv, un = self._np
        for b, k in enumerate(tokens_per_row(live)):
            lv[b] += k
            un[b] = min(un[b] + k, rollback_limit)

    def forget(self, n: torch.Tensor | int) -> None:
        """Rows forget their last n (B,) tokens (checked by the caller: n <= `rollbackable`)."""
        on_cpu = not isinstance(n, torch.Tensor) or n.device.type == "cpu"
        if self._np is None or not on_cpu or torch.compiler.is_compiling():
            self.live.sub_(n)
            self.undo.sub_(n)
            return
        k = n.numpy() if isinstance(n, torch.Tensor) else n  # numpy, as in `fed`
        lv, un = self._np
        lv -= k
        un -= k

    @property
    def rollbackable(self) -> torch.Tensor:
        """(B,) the most tokens each row can forget now."""
        return torch.minimum(self.undo, self.live)

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Rows (a (n,) int64 index; None: every row) start afresh, nothing to forget."""
        rows = slice(None) if rows is None else rows
        self.live[rows] = 0
        self.undo[rows] = 0

    def reorder(self, idx: torch.Tensor) -> None:
        """Row b takes the counts of row idx[b] (beam search)."""
        self.live.copy_(self.live.index_select(0, idx))
        self.undo.copy_(self.undo.index_select(0, idx))


def tokens_per_row(live: torch.Tensor) -> list[int]:
    """Each row's live tokens in a (B,) or (B, C) bool mask, as Python ints (read by `tolist`:
    no dispatched torch op; for a few values, `validation.SMALL`)."""
    return [sum(r) if isinstance(r, list) else int(r) for r in live.tolist()]


def padded_chunks(ids: torch.Tensor, live: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor, range]:
    """ids and live (B, N), padded with dead tokens to a multiple of C, and the first column
    of each C-column chunk."""
    pad = (-ids.shape[1]) % C
    return F.pad(ids, (0, pad)), F.pad(live, (0, pad)), range(0, ids.shape[1] + pad, C)


def canonical(t: torch.Tensor) -> torch.Tensor:
    """t itself if it starts its storage with contiguous strides, else a contiguous copy.

    WHY: a compiled step guards on its inputs' strides, and a one-row column slice keeps its
    parent's row stride (`.contiguous()` is then a no-op), which made every prefill recompile."""
    stride, n = t.stride(), 1
    for i in range(len(stride) - 1, -1, -1):  # against the contiguous strides, innermost first
        if stride[i] != n:
            return t.clone(memory_format=torch.contiguous_format)
        n *= t.shape[i]
    return t if t.storage_offset() == 0 else t.clone(memory_format=torch.contiguous_format)


def last_live(live: torch.Tensor) -> torch.Tensor:
    """(B,) the column of each row's last live token in live (B, C) (0 for a row without one)."""
    return (torch.arange(live.shape[1], device=live.device) * live).amax(1)
