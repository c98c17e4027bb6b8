"""transformers Auto classes: importing shram_static registers "shram", so AutoConfig and
AutoModelForCausalLM load SHRAM checkpoints (the original code's, with their `auto_map`) into
this package without trust_remote_code, and broken directories fail with clear errors."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import DATA, GOLDEN_CASES, random_model
from oracle import CONFIG_DEFAULTS
from shram_static import CheckpointError, ShramConfig, ShramForCausalLM


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_auto_classes_load_every_golden_checkpoint(name):
    path = os.path.join(DATA, name)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert "auto_map" in raw  # written by the original code, pointing at its remote code
    config = AutoConfig.from_pretrained(path)
    assert type(config) is ShramConfig
    for field in CONFIG_DEFAULTS:
        if field in raw:
            assert getattr(config, field) == raw[field], field
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model) is ShramForCausalLM and not model.training
    sd, want = model.state_dict(), load_file(os.path.join(path, "model.safetensors"))
    assert set(want) <= set(sd)
    for k, v in want.items():
        assert torch.equal(sd[k], v.float()), k
    g = load_file(os.path.join(path, "golden.safetensors"))
    live = g["attention_mask"].bool()
    logits = model(g["input_ids"], g["attention_mask"]).logits
    torch.testing.assert_close(logits[live], g["logits_full"][live], atol=2e-4, rtol=1e-4)


def test_auto_model_options(tmp_path):
    path = os.path.join(DATA, "main_basic")
    assert AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_pretrained(path, dtype="auto").dtype == torch.float32
    # Config overrides are applied by AutoConfig and honoured.
    model = AutoModelForCausalLM.from_pretrained(path, inference_sequence_length=128)
    assert model.config.inference_sequence_length == 128
    with pytest.raises(TypeError, match="device_map"):
        AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    # What save_pretrained writes loads back through the Auto classes.
    random_model(401).save_pretrained(tmp_path / "saved")
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "saved")) is ShramForCausalLM


@pytest.fixture
def ckpt(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "main_basic"), dst)
    return dst


def _edit_config(path, drop=(), **changes):
    with open(path / "config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    for k in drop:
        del raw[k]
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)


def test_unknown_model_type_fails_clearly(ckpt):
    # Without auto_map (with it, transformers asks for trust_remote_code, as for any remote model).
    _edit_config(ckpt, model_type="not_a_model_type", drop=["auto_map"])
    for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="not_a_model_type"):
            load(ckpt)
    with pytest.raises(CheckpointError, match="model_type"):
        ShramForCausalLM.from_pretrained(ckpt)


def test_malformed_config_fails_clearly(ckpt):
    _edit_config(ckpt, head_dim=15)
    for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="head_dim must be even"):
            load(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(OSError, match="not a valid JSON"):
        AutoModelForCausalLM.from_pretrained(ckpt)


def test_broken_weights_fail_with_checkpoint_error(ckpt):
    sd = load_file(ckpt / "model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing keys.*model.norm.weight"):
        AutoModelForCausalLM.from_pretrained(ckpt)
