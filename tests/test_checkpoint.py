"""Checkpoint directories (docs/design.md, "Checkpoint layout"): round trips, the original key layout, bf16/fp16 files and
every way a directory can be broken."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import DATA, GOLDEN_CASES, random_ids, random_model
from shram_static import CheckpointError, ShramConfig, ShramForCausalLM


def _keys(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("seed, overrides", [
    (300, dict(tie_word_embeddings=False, use_residual_gate=True)),
    (301, dict(tie_word_embeddings=True, use_residual_gate=True)),
    (302, dict(tie_word_embeddings=True, use_residual_gate=False, rope_mode="semantic_sequence")),
    (303, dict(tie_word_embeddings=False, use_residual_gate=False)),
])
def test_round_trip_is_exact(tmp_path, seed, overrides):
    model = random_model(seed, **overrides)
    ids = random_ids(model.config, 2, 20, seed)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :4] = False
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    back = ShramForCausalLM.from_pretrained(tmp_path)
    assert not back.training
    assert back.config.to_dict() == model.config.to_dict()
    assert torch.equal(back(ids, mask).logits, model(ids, mask).logits)
    sd, sd_back = model.state_dict(), back.state_dict()
    assert sd.keys() == sd_back.keys()
    for k in sd:
        assert torch.equal(sd[k], sd_back[k]), k
    # The residual scales are in the file (parameters or, without gates, buffers), as in the original.
    assert "model.layers.0.attn_residual_scale" in _keys(tmp_path)


def test_tied_embeddings_stored_once(tmp_path):
    model = random_model(310, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    keys = _keys(tmp_path)
    assert "embed_tokens.weight" in keys and not any(k.startswith("lm_head") for k in keys)
    back = ShramForCausalLM.from_pretrained(tmp_path)
    assert back.output_weight.data_ptr() == back.embed_tokens.weight.data_ptr()
    untied = random_model(311, tie_word_embeddings=False)
    untied.save_pretrained(tmp_path / "untied")
    assert "lm_head.weight" in _keys(tmp_path / "untied")


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_saved_layout_is_the_original_layout(tmp_path, name):
    """What we save has exactly the key set, shapes and (for a loaded checkpoint) values of the
    file the original code wrote for the same config."""
    golden = os.path.join(DATA, name)
    ref = load_file(os.path.join(golden, "model.safetensors"))
    fresh = ShramForCausalLM(ShramConfig.from_pretrained(golden))
    fresh.save_pretrained(tmp_path / "fresh")
    saved = load_file(os.path.join(tmp_path / "fresh", "model.safetensors"))
    assert set(saved) == set(ref)
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    ShramForCausalLM.from_pretrained(golden).save_pretrained(tmp_path / "again")
    again = load_file(os.path.join(tmp_path / "again", "model.safetensors"))
    for k in ref:
        assert again[k].dtype == torch.float32 and torch.equal(again[k], ref[k]), k


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_load(tmp_path, file_dtype):
    model = random_model(320, tie_word_embeddings=False)
    ids = random_ids(model.config, 1, 16, 320)
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    sd = load_file(path)
    save_file({k: v.to(file_dtype) for k, v in sd.items()}, path)

    loaded = ShramForCausalLM.from_pretrained(tmp_path)  # default dtype: fp32
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    rounded = {k: v.to(file_dtype).float() for k, v in sd.items()}
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, rounded[k]), k  # exactly the file's values, widened
    # Logits: exactly those of the fp32 model with rounded weights; near the unrounded ones.
    ref = random_model(320, tie_word_embeddings=False)
    ref.load_state_dict(rounded)
    assert torch.equal(loaded(ids).logits, ref(ids).logits)
    full = model(ids).logits
    rel = ((loaded(ids).logits - full).abs().max() / full.abs().max()).item()
    assert rel < (0.05 if file_dtype == torch.bfloat16 else 0.01), rel

    as_file = ShramForCausalLM.from_pretrained(tmp_path, dtype=file_dtype)
    assert all(p.dtype == file_dtype for p in as_file.parameters())
    out = as_file(ids).logits
    assert out.dtype == file_dtype and bool(out.isfinite().all())


# -- broken checkpoints ------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    model = random_model(330, tie_word_embeddings=False)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    return path


def _edit_weights(path, fn):
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


def _load_error(path, exc=CheckpointError):
    with pytest.raises(exc) as e:
        ShramForCausalLM.from_pretrained(path)
    return str(e.value)


def test_missing_key(ckpt):
    _edit_weights(ckpt, lambda sd: sd.pop("model.layers.0.mlp.up_proj.weight"))
    msg = _load_error(ckpt)
    assert "missing" in msg and "model.layers.0.mlp.up_proj.weight" in msg and "model.safetensors" in msg


def test_missing_lm_head_of_untied_model(ckpt):
    _edit_weights(ckpt, lambda sd: sd.pop("lm_head.weight"))
    msg = _load_error(ckpt)
    assert "missing" in msg and "lm_head.weight" in msg


def test_unexpected_key(ckpt):
    _edit_weights(ckpt, lambda sd: sd.__setitem__("model.layers.0.attention.bias", torch.zeros(3)))
    msg = _load_error(ckpt)
    assert "unexpected" in msg and "model.layers.0.attention.bias" in msg


def test_misshapen_key(ckpt):
    def shrink(sd):
        k = "model.layers.0.attention.sparse_attention.bea.q_proj"
        sd[k] = sd[k][:, :, :-2].contiguous()
    _edit_weights(ckpt, shrink)
    msg = _load_error(ckpt)
    assert "misshapen" in msg and "model.layers.0.attention.sparse_attention.bea.q_proj" in msg
    assert "expected" in msg


def test_unsupported_dtype(ckpt):
    _edit_weights(ckpt, lambda sd: sd.__setitem__("model.norm.weight", sd["model.norm.weight"].to(torch.int32)))
    msg = _load_error(ckpt)
    assert "model.norm.weight" in msg and "dtype" in msg


def test_long_key_lists_are_shortened(ckpt):
    """A config/weights mismatch names the first keys and counts the rest."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_decoder_layers"] += 9
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(ckpt)
    assert "missing keys" in msg and "more" in msg and len(msg) < 3000


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_file(ckpt, name):
    os.remove(ckpt / name)
    msg = _load_error(ckpt, FileNotFoundError)
    assert name in msg and str(ckpt) in msg


def test_missing_dir(tmp_path):
    msg = _load_error(tmp_path / "nowhere", FileNotFoundError)
    assert "nowhere" in msg and "does not exist" in msg


def test_path_is_a_file(ckpt):
    msg = _load_error(ckpt / "config.json", NotADirectoryError)
    assert "config.json" in msg and "directory" in msg


def test_the_commands_checkpoint_check_passes_the_builtin_model(ckpt):
    """`check_checkpoint_dir` (what every command runs before importing torch) passes None, a
    command's built-in model, and a whole checkpoint; `from_pretrained` refuses None by its type."""
    from shram_static.checkpoint_dir import check_checkpoint_dir

    check_checkpoint_dir(None)
    check_checkpoint_dir(str(ckpt))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        os.remove(ckpt / "model.safetensors")
        check_checkpoint_dir(str(ckpt))
    with pytest.raises(TypeError):
        ShramForCausalLM.from_pretrained(None)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unreadable_safetensors(ckpt, damage):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"not a safetensors file" * 50,
                   "empty": b""}[damage])
    msg = _load_error(ckpt)
    assert "model.safetensors" in msg and "safetensors" in msg


@pytest.mark.parametrize("text, words", [
    ("{not json", ["config.json", "not valid JSON"]),
    ("[1, 2]", ["config.json", "JSON object"]),
    ('{"model_type": "llama", "vocab_size": 10}', ["config.json", "model_type", "llama"]),
    ('{"model_type": "shram", "head_dim": 15}', ["config.json", "head_dim", "even"]),
    ('{"model_type": "shram", "rope_mode": "xx"}', ["config.json", "rope_mode"]),
])
def test_invalid_config_json(ckpt, text, words):
    (ckpt / "config.json").write_text(text)
    msg = _load_error(ckpt)
    for w in words:
        assert w in msg, msg


def test_config_json_not_utf8(ckpt):
    (ckpt / "config.json").write_bytes(b"\xff\xfe\x00\x01garbage")
    assert "config.json" in _load_error(ckpt)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_golden_dirs_load_unchanged(tmp_path):
    """Loading never writes into the checkpoint directory."""
    src = os.path.join(DATA, "semantic_tied")
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    before = {p: (dst / p).read_bytes() for p in os.listdir(dst)}
    ShramForCausalLM.from_pretrained(dst)
    assert {p: (dst / p).read_bytes() for p in os.listdir(dst)} == before
