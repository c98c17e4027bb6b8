"""The benchmark commands: `bench` (`throughput`), `bench-speculative` (`speculative`), `cli`, `checks`,
`readings`, `plot`; `throughput`'s names (`build_model`) are reachable here too, imported on first use."""

import importlib

_SUBMODULES = ("checks", "cli", "plot", "readings", "speculative", "throughput")


def __getattr__(name: str):
    # A submodule's name is left to the import system (`from .bench import cli` asks here first).
    if name.startswith("_") or name in _SUBMODULES:
        raise AttributeError(f"module 'shram_static.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(".throughput", __name__), name)
