"""ShramConfig (docs/design.md, "Config"): defaults, validation, derived sizes and config.json round trips."""

import json
import os

import pytest

from helpers import DATA, GOLDEN_CASES
from oracle import CONFIG_DEFAULTS
from shram_static import ShramConfig

# The defaults of docs/design.md, "Config", as transcribed once for the oracle; inference_sequence_length resolves to
# training_sequence_length.
SPEC_DEFAULTS = {**CONFIG_DEFAULTS, "inference_sequence_length": 1024}
FIELDS = list(SPEC_DEFAULTS)


def test_defaults():
    c = ShramConfig()
    assert c.model_type == "shram"
    for k, v in SPEC_DEFAULTS.items():
        assert getattr(c, k) == v, k
        assert type(getattr(c, k)) is type(v), k


def test_inference_length_defaults_to_training_length():
    assert ShramConfig(training_sequence_length=100).inference_sequence_length == 100
    assert ShramConfig(training_sequence_length=100, inference_sequence_length=None).inference_sequence_length == 100
    assert ShramConfig(training_sequence_length=100, inference_sequence_length=300).inference_sequence_length == 300


# -- validation ---------------------------------------------------------------------------
POSITIVE_INTS = ["vocab_size", "embedding_width", "mlp_width", "num_decoder_layers",
                 "num_sliding_window_heads", "num_mosrah_heads", "num_selected_heads", "head_dim",
                 "window_size", "training_sequence_length", "inference_sequence_length"]


@pytest.mark.parametrize("field", POSITIVE_INTS)
@pytest.mark.parametrize("value", [0, -4, 2.5, "8", True])
def test_positive_int_fields(field, value):
    kwargs = {field: value}
    if field in ("num_mosrah_heads", "num_selected_heads"):
        kwargs = {"num_mosrah_heads": 16, "num_selected_heads": 16, field: value}
    with pytest.raises(ValueError, match=field):
        ShramConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field, hint", [
    (dict(head_dim=15), "head_dim", "even"),
    (dict(head_dim=3), "head_dim", "even"),
    (dict(rope_mode="semantic"), "rope_mode", "main_sequence"),
    (dict(rope_mode="yarn"), "rope_mode", "semantic_sequence"),
    (dict(num_mosrah_heads=16, num_selected_heads=3), "num_mosrah_heads", "multiple"),
    (dict(num_mosrah_heads=6, num_selected_heads=4), "num_selected_heads", "multiple"),
    (dict(attention_dropout=0.1), "attention_dropout", "0.0"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps", "positive"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps", "positive"),
    (dict(alpha=32.0, beta=1.0), "beta", "alpha"),
])
def test_validation_rules(kwargs, field, hint):
    with pytest.raises(ValueError) as e:
        ShramConfig(**kwargs)
    assert field in str(e.value) and hint in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(num_mosrah_heads=8, num_selected_heads=8),
    dict(num_mosrah_heads=8, num_selected_heads=1),
    dict(head_dim=2, rope_mode="semantic_sequence"),
    dict(training_sequence_length=1, inference_sequence_length=1),
])
def test_valid_edge_configs(kwargs):
    ShramConfig(**kwargs)


def test_validation_applies_to_config_json(tmp_path):
    with open(os.path.join(DATA, "main_basic", "config.json")) as f:
        raw = json.load(f)
    raw["head_dim"] = 15
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="head_dim"):
        ShramConfig.from_json_file(str(tmp_path / "config.json"))


# -- derived sizes (hand-computed) ----------------------------------------------------------
@pytest.mark.parametrize("kwargs, W, s, cache, packed", [
    # ceil(1024*16/16) + 1 = 1025
    (dict(), 1, 1.0, 1025, 1025),
    # W = 8/2 = 4; s = 100/50; ceil(100*2/8)=25 (+4); ceil(50*2/8)=ceil(12.5)=13 (+4)
    (dict(num_mosrah_heads=8, num_selected_heads=2, training_sequence_length=50,
          inference_sequence_length=100), 4, 2.0, 29, 17),
    # W = 12/3 = 4; ceil(10*3/12)=ceil(2.5)=3 (+4); ceil(10*3/12)=3 (+4)
    (dict(num_mosrah_heads=12, num_selected_heads=3, training_sequence_length=10), 4, 1.0, 7, 7),
    # W = 6/2 = 3; s = 64/16 = 4; ceil(64*2/6)=ceil(21.33)=22 (+3); ceil(16*2/6)=ceil(5.33)=6 (+3)
    (dict(num_mosrah_heads=6, num_selected_heads=2, training_sequence_length=16,
          inference_sequence_length=64), 3, 4.0, 25, 9),
    # W = 8/8 = 1; s = 30/20 = 1.5; 30 + 1; 20 + 1
    (dict(num_mosrah_heads=8, num_selected_heads=8, training_sequence_length=20,
          inference_sequence_length=30), 1, 1.5, 31, 21),
])
def test_derived_sizes(kwargs, W, s, cache, packed):
    c = ShramConfig(**kwargs)
    assert c.block_length == W
    assert c.scale == pytest.approx(s)
    assert c.mosrah_cache_length == cache
    assert c.mosrah_packed_length == packed


# -- config.json --------------------------------------------------------------------------
NON_DEFAULT = dict(vocab_size=300, embedding_width=40, mlp_width=72, num_decoder_layers=3,
                   num_sliding_window_heads=5, num_mosrah_heads=12, num_selected_heads=4, head_dim=6,
                   window_size=7, rope_mode="semantic_sequence", rms_norm_eps=1e-6,
                   local_rope_theta=500.0, mosrah_rope_theta=2000.0, training_sequence_length=48,
                   inference_sequence_length=192, alpha=2.0, beta=16.0, attention_dropout=0.0,
                   tie_word_embeddings=True, use_residual_gate=False)


@pytest.mark.parametrize("kwargs", [NON_DEFAULT, {}])
def test_json_round_trip(tmp_path, kwargs):
    c = ShramConfig(**kwargs)
    c.to_json_file(str(tmp_path / "config.json"))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "shram"
    want = {**SPEC_DEFAULTS, **kwargs}
    for k in FIELDS:  # every field written, so any reader sees the same config
        assert raw[k] == want[k], k
    back = ShramConfig.from_json_file(str(tmp_path / "config.json"))
    for k in FIELDS:
        assert getattr(back, k) == want[k], k
    c.save_pretrained(str(tmp_path / "dir"))
    again = ShramConfig.from_pretrained(str(tmp_path / "dir"))
    assert {k: getattr(again, k) for k in FIELDS} == want


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden_config_json(tmp_path, name):
    """Files written by the original code (auto_map, transformers_version, use_cache) load with
    every field as written, and survive a rewrite."""
    path = os.path.join(DATA, name, "config.json")
    with open(path) as f:
        raw = json.load(f)
    assert "auto_map" in raw and "use_cache" in raw and "transformers_version" in raw
    for load in (ShramConfig.from_json_file, lambda p: ShramConfig.from_pretrained(os.path.dirname(p))):
        c = load(path)
        for k in FIELDS:
            assert getattr(c, k) == raw[k], (name, k)
    c.to_json_file(str(tmp_path / "config.json"))
    back = ShramConfig.from_json_file(str(tmp_path / "config.json"))
    for k in FIELDS:
        assert getattr(back, k) == raw[k], (name, k)


def test_unknown_keys_accepted(tmp_path):
    raw = {"model_type": "shram", "vocab_size": 99, "some_future_key": [1, 2], "use_cache": False,
           "auto_map": {"AutoConfig": "configuration.ShramConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = ShramConfig.from_json_file(str(tmp_path / "config.json"))
    assert c.vocab_size == 99
    assert c.inference_sequence_length == c.training_sequence_length == 1024
