"""The host's per-call checks and counts, which read a few values as Python ints
(`validation.SMALL`) and more through torch ops: both paths against plain Python oracles."""

import pytest
import torch

from shram_static.rows import RowCounts
from shram_static.validation import SMALL, check_input_ids

V = 50


@pytest.mark.parametrize("shape", [(), (3,), (2, 5), (2, 3, 4), (SMALL + 44,), (2, SMALL)])
def test_check_input_ids_both_paths(shape):
    g = torch.Generator().manual_seed(len(shape))
    ids = torch.randint(0, V, shape, generator=g)
    check_input_ids(ids, V)  # every id in [0, V)
    for bad in (V, -1, V + 7):
        t = ids.clone()
        t.view(-1)[-1] = bad
        assert not all(0 <= x < V for x in t.view(-1).tolist())  # the oracle agrees it is bad
        with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {V}\): \[{bad}\]"):
            check_input_ids(t, V)


@pytest.mark.parametrize("B,C", [(1, 1), (2, 5), (3, SMALL)])
def test_row_counts_fed_matches_oracle(B, C):
    g = torch.Generator().manual_seed(B * C)
    counts, limit = RowCounts(B), 6
    live, undo = [0] * B, [0] * B  # the oracle
    for _ in range(4):
        mask = torch.rand(B, C, generator=g) < 0.6
        counts.fed(mask, limit)
        for b, row in enumerate(mask.tolist()):
            live[b] += sum(row)
            undo[b] = min(undo[b] + sum(row), limit)
        assert counts.live.tolist() == live and counts.undo.tolist() == undo
        k = min(min(undo), 1)  # every row forgets k tokens
        counts.forget(torch.full((B,), k))
        live, undo = [x - k for x in live], [x - k for x in undo]


def test_row_counts_fed_traced():
    """A compiled forward that runs a `ShramCache` traces `fed` with no graph break."""
    counts = RowCounts(2)
    fed = torch.compile(lambda m: counts.fed(m, 3), fullgraph=True, backend="eager")
    fed(torch.tensor([[True, False, True], [False, False, True]]))
    fed(torch.tensor([[True, True, True], [False, False, False]]))
    assert counts.live.tolist() == [5, 1] and counts.undo.tolist() == [3, 1]
