"""The models the benchmarks run, named by a word or by a checkpoint directory, checked without
importing torch (a wrong name is refused at once, not after seconds of imports)."""

from ..checkpoint_dir import check_checkpoint_dir

MODELS = ("bench", "builtin")  # the models named by a word; any other name is a checkpoint directory


def check_models(names: list[str]) -> None:
    """Refuses, without importing torch, the names that are neither in `MODELS` nor a checkpoint
    directory (`config.json` and `model.safetensors`).

    Args:
        names: the models a command benchmarks.

    Raises:
        ValueError: naming each such name.
    """
    bad = []
    for name in names:
        if name not in MODELS:
            try:
                check_checkpoint_dir(name)
            except OSError:
                bad.append(name)
    if bad:
        raise ValueError(f"unknown models {bad}: use {', '.join(map(repr, MODELS))} or checkpoint "
                         f"directories (with config.json and model.safetensors)")
