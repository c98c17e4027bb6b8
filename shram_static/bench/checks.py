"""A benchmark command's arguments, checked without importing torch (a wrong one is refused at
once, not after seconds of imports): the models, named by a word or by a checkpoint directory,
the sizes and the depths."""

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


def check_depths(depths: list[int] | None, steps: int, capacity: int) -> None:
    """ValueError unless each of `depths` (None: the defaults) leaves room for `steps` steps in `capacity`."""
    if depths and max(depths) + steps >= capacity:
        raise ValueError(f"--depths must leave room for {steps} decode steps within the capacity {capacity}: "
                         f"at most {capacity - steps - 1}, got {max(depths)}")


def check_bench(args) -> None:
    """Checks `bench`'s arguments (`cli.add_arguments`) before anything runs.

    Args:
        args: the parsed arguments.

    Raises:
        ValueError: an unknown model, a size or round count below 1, or depths past `--capacity`
            (a model's own capacity is checked in its worker).
    """
    check_models(args.models)
    if any(b < 1 for b in args.batch_sizes) or args.steps < 1 or args.prefill_chunk < 1:
        raise ValueError("--batch-sizes, --steps and --prefill-chunk must be positive")
    if args.rounds < 1:
        raise ValueError("--rounds must be positive")
    if args.capacity:
        check_depths(args.depths, args.steps, args.capacity)
