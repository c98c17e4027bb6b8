"""Check the float64 reference oracle (tests/oracle.py) against the golden cases."""

import os
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle import entmax_bisect_12, load_checkpoint, oracle_forward, oracle_greedy  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CASES = ["main_basic", "semantic_tied", "yarn_extended", "left_padded"]


def _case(name):
    cfg, sd = load_checkpoint(os.path.join(DATA, name))
    golden = load_file(os.path.join(DATA, name, "golden.safetensors"))
    return cfg, sd, golden


@pytest.mark.parametrize("name", CASES)
def test_oracle_matches_golden_forward(name):
    cfg, sd, g = _case(name)
    mask = g["attention_mask"].bool()
    logits, selected = oracle_forward(cfg, sd, g["input_ids"], mask)
    assert logits.dtype == torch.float64
    assert logits.shape == g["logits_full"].shape
    assert selected.shape == g["selected_heads"].shape
    err = (logits - g["logits_full"].double())[mask].abs().max().item()
    assert err <= 1e-3, f"{name}: max abs logit error {err}"
    assert torch.equal(selected[:, mask], g["selected_heads"][:, mask])
    # dead positions: -1 selections, zero logits
    assert bool((selected[:, ~mask] == -1).all())
    assert bool((logits[~mask] == 0).all())


@pytest.mark.parametrize("name", CASES)
def test_oracle_matches_golden_greedy(name):
    cfg, sd, g = _case(name)
    P = int(g["prompt_len"])
    n = g["greedy_tokens"].shape[1]
    tokens = oracle_greedy(cfg, sd, g["input_ids"][:, :P], g["attention_mask"][:, :P].bool(), n)
    assert torch.equal(tokens, g["greedy_tokens"])


def test_padding_is_noop():
    """A left-padded row gives the logits it gives alone (oracle sanity, docs/design.md, "The network")."""
    cfg, sd, g = _case("left_padded")
    mask = g["attention_mask"].bool()
    logits, selected = oracle_forward(cfg, sd, g["input_ids"], mask)
    for b in range(mask.shape[0]):
        ids = g["input_ids"][b][mask[b]][None]
        lb, sb = oracle_forward(cfg, sd, ids, None)
        assert torch.equal(lb[0], logits[b][mask[b]])
        assert torch.equal(sb[:, 0], selected[:, b][:, mask[b]])


def test_entmax_matches_reference_package():
    entmax = pytest.importorskip("entmax")
    gen = torch.Generator().manual_seed(0)
    for L in (2, 3, 6, 8, 16):
        for scale in (0.1, 1.0, 5.0, 30.0):
            z = torch.randn(20, L, generator=gen, dtype=torch.float64) * scale
            ref = entmax.entmax_bisect(z, alpha=1.2, dim=-1)
            ours = torch.tensor([entmax_bisect_12(row.tolist()) for row in z], dtype=torch.float64)
            assert (ours - ref).abs().max().item() <= 1e-6, (L, scale)
            assert torch.allclose(ours.sum(-1), torch.ones(20, dtype=torch.float64))
