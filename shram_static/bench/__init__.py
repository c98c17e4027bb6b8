"""The benchmark commands: `bench` (`throughput`), `bench-speculative` (`speculative`), their
arguments (`cli`, parsed without torch), `readings` of the machine and the model, `plot`, and
the models they run (`throughput.build_model`: the bench config, the built-in model, a
checkpoint), also reachable as `shram_static.bench.build_model` (imported on first use).
"""

import importlib

_SUBMODULES = ("cli", "plot", "readings", "speculative", "throughput")


def __getattr__(name: str):
    # A submodule's name is left to the import system (`from .bench import cli` asks here first).
    if name.startswith("_") or name in _SUBMODULES:
        raise AttributeError(f"module 'shram_static.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(".throughput", __name__), name)
