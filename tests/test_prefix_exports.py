"""The prefix lengths of exported steps (`export/common.py`'s `export_prefix_lengths`,
`state.PrefixSlots`): which lengths an export carries, which one a runner feeds, and the arguments
an export refuses before tracing anything, and the `.pte`'s batch-1 decode method over a prefix.
The exported steps of several rows are checked against the eager decoder in test_export_pte.py
and test_export_onnx.py (`helpers.check_prefix_steps`)."""

import pytest
import torch

from helpers import fed_prefixes, tiny_model

from shram_static import StaticDecoder
from shram_static.bench.throughput import BENCH_CONFIG
from shram_static.config import ShramConfig
from shram_static.export import export_onnx, export_pte, load_pte
from shram_static.export.common import export_prefix_lengths
from shram_static.state import PrefixSlots


def test_default_lengths_are_powers_of_two_then_the_cache():
    cfg = ShramConfig(**{**BENCH_CONFIG, "inference_sequence_length": 8192})
    T = cfg.mosrah_cache_length
    assert T == 8192 * 4 // 16 + 4  # ceil(S * K / L) + W
    assert export_prefix_lengths(cfg) == (64, 128, 256, 512, 1024, T)
    small = tiny_model(num_decoder_layers=1, training_sequence_length=64).config  # T = 20 < 2 * 64
    assert export_prefix_lengths(small) == ()  # whole-cache steps, no slots input
    assert export_prefix_lengths(small, (4, 8)) == (4, 8, 20)
    assert export_prefix_lengths(small, [4, 20]) == (4, 20)
    assert export_prefix_lengths(small, ()) == export_prefix_lengths(small, (20,)) == ()


def test_bad_lengths_are_refused_before_tracing(tmp_path):
    model = tiny_model(num_decoder_layers=1, training_sequence_length=64)  # T = 20
    for bad in [(8, 4), (4, 4), (1, 8), (0,), (21,), (4.0, 8), (True, 8), (-4,)]:
        with pytest.raises(ValueError, match="prefix_lengths"):
            export_prefix_lengths(model.config, bad)
    for export in (export_pte, export_onnx):
        with pytest.raises(ValueError, match="prefix_lengths"):
            export(model, tmp_path / "x", prefix_lengths=(8, 4))
    with pytest.raises(TypeError, match="prefix_decode"):
        export_pte(model, tmp_path / "x", prefix_lengths=(4, 8), prefix_decode=1)
    assert not list(tmp_path.iterdir())


def test_runner_feeds_the_shortest_length_holding_every_live_slot():
    """Against counting: a row of n live tokens after the step holds ceil(n / W) tokens in its
    fullest expert, at slots 0 .. ceil(n / W) - 1, numbered as the step numbers them."""
    cfg = tiny_model(num_decoder_layers=1, training_sequence_length=64).config
    W, lengths = cfg.block_length, (4, 8, 20)
    pick = PrefixSlots(cfg, lengths)
    for chunk in (1, 4):
        for deepest in range(0, cfg.inference_sequence_length - chunk + 1):
            pos = torch.tensor([deepest // 3, deepest, 0])
            slots = pick(pos, chunk)
            need = -(-(deepest + chunk) // W)
            assert slots.shape[0] == min(p for p in lengths if p >= need), (chunk, deepest)
            assert slots.dtype == torch.float32 and slots.is_contiguous()
            assert torch.equal(slots, torch.arange(slots.shape[0], dtype=torch.float32))


@pytest.mark.heavy
def test_batch_one_decode_method_over_a_prefix(tmp_path, monkeypatch):
    """At batch 1 an export with prefix lengths and `prefix_decode` keeps the stock runner's
    `forward(tokens, input_pos)` over the whole cache and adds `decode(tokens, input_pos, live,
    slots)`, which `load_pte` runs: a decode-only program fed 44 tokens one by one gives the eager decoder's
    logits (within 1e-5) while the length it feeds grows 4, 8, 20 with the depth."""
    model = tiny_model(num_decoder_layers=1, training_sequence_length=64)  # T = 20, W = 4
    path = export_pte(model, tmp_path / "m.pte", prefill_chunk=None, prefix_lengths=(4, 8), prefix_decode=True)
    dec = load_pte(path)
    assert dec.meta["decode_method"] == "forward" and dec.meta["slots_methods"] == ["decode"]
    assert dec._program.metadata("forward").num_inputs() == 2 and dec._program.metadata("decode").num_inputs() == 4
    fed = fed_prefixes(dec, monkeypatch)
    ref = StaticDecoder(model, 1, 1)
    ids = torch.randint(0, 256, (1, 44), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(dec.prefill(ids), ref.prefill(ids), atol=1e-5, rtol=0)
    assert [p for _, p in fed] == [4] * 16 + [8] * 16 + [20] * 12
