"""Checkpoint I/O: `config.json` + `model.safetensors` in the original layout (docs/design.md, "Checkpoint layout")."""

import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .checkpoint_dir import CONFIG_FILE, WEIGHTS_FILE, check_checkpoint_dir
from .config import ShramConfig
from .errors import CheckpointError
from .rope import RotaryTables

LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _some(items: list[str], n: int = 10) -> str:
    """The first n items, and how many more."""
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return f"{items[:n]}{more}"


# Options transformers' Auto classes pass on to `from_pretrained`: none changes a local directory's load.
IGNORED_KWARGS = frozenset({"_from_auto", "adapter_kwargs", "trust_remote_code", "revision", "cache_dir",
                            "force_download", "local_files_only", "proxies", "token", "code_revision",
                            "_commit_hash"})


def _resolve_kwargs(path: str, dtype, kwargs: dict):
    """(path, dtype) after the Auto-class options: `subfolder`, `torch_dtype` (alias of dtype)."""
    torch_dtype, subfolder = kwargs.pop("torch_dtype", None), kwargs.pop("subfolder", None)
    dtype = dtype if torch_dtype is None else torch_dtype
    path = os.path.join(path, subfolder) if subfolder else path
    unknown = sorted(k for k in kwargs if k not in IGNORED_KWARGS)
    if unknown:
        raise TypeError(f"ShramForCausalLM.from_pretrained got unsupported keyword arguments {unknown}; "
                        f"it takes a local checkpoint directory, dtype= and config=")
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
        dtype = getattr(torch, dtype)
    if dtype != "auto" and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or 'auto', got {dtype!r}")
    return path, dtype


def load_pretrained(cls, path, dtype: torch.dtype | str = torch.float32, config: ShramConfig | None = None,
                    check_finite: bool = True, **kwargs):
    """See `ShramForCausalLM.from_pretrained`."""
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
    path, dtype = _resolve_kwargs(os.fspath(path), dtype, kwargs)
    if config is not None and not isinstance(config, ShramConfig):
        raise TypeError(f"config must be a ShramConfig, got {type(config).__name__}")
    check_checkpoint_dir(path)
    if config is None:
        config = _read_config(os.path.join(path, CONFIG_FILE))
    weights = os.path.join(path, WEIGHTS_FILE)
    try:
        sd = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is not a readable safetensors file: {e}") from e
    # built on the meta device (no random init, no global-RNG use), then given the file's tensors
    with torch.device("meta"):
        model = cls(config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # tied lm_head excluded
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    wrong = sorted(f"{k}: file {tuple(sd[k].shape)}, expected {want[k]}"
                   for k in set(want) & set(sd) if tuple(sd[k].shape) != want[k])
    bad_dtype = sorted(f"{k}: {sd[k].dtype}" for k in sd if sd[k].dtype not in LOADABLE_DTYPES)
    problems = [f"{what} {_some(keys)}" for what, keys in (
        ("missing keys", missing), ("unexpected keys", extra), ("misshapen keys", wrong),
        ("keys of unsupported dtype (need fp32, bf16 or fp16)", bad_dtype)) if keys]
    if problems:
        raise CheckpointError(f"{weights} does not match its config.json: " + "; ".join(problems))
    if check_finite:
        check_finite_tensors(sd, weights)
    if dtype == "auto":  # the file's dtype (its first floating tensor's)
        dtype = next(iter(sd.values())).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True, assign=True)
    model.rope = RotaryTables(config)  # the computed tables, made for real
    return model.eval()


def check_finite_tensors(sd: dict, where: str) -> None:
    """Raises CheckpointError naming every tensor of `sd` that holds a NaN or an Inf (`where`: the
    file). WHY at load: one NaN weight makes every logit NaN, and greedy decoding emits token 0."""
    bad = []
    for k, t in sorted(sd.items()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            bad.append(f"{k} ({nan} NaN, {inf} Inf of {t.numel()})")
    if bad:
        raise CheckpointError(f"{where} holds non-finite values in {_some(bad)}; the weights are "
                              f"corrupt (pass check_finite=False to load them anyway)")


def _read_config(config_path: str) -> ShramConfig:
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object of config fields, got a "
                              f"JSON {type(raw).__name__}")
    if raw.get("model_type", ShramConfig.model_type) != ShramConfig.model_type:
        raise CheckpointError(f"{config_path} has model_type {raw['model_type']!r}; this package loads "
                              f"only {ShramConfig.model_type!r} checkpoints")
    try:
        return ShramConfig.from_json_file(config_path)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{config_path} is not a valid SHRAM config: {e}") from e


def save_pretrained(model, path) -> None:
    """See `ShramForCausalLM.save_pretrained`."""
    os.makedirs(path, exist_ok=True)
    model.config.to_json_file(os.path.join(path, CONFIG_FILE))
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
