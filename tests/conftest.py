"""Test-wide settings, and the order of the test files under pytest-xdist."""

import collections
import json
import os

import pytest
import torch

# A test file's cost under xdist: its measured seconds (`COSTS`, written by scripts/xdist_costs.py),
# else a guess from its marks: seconds per `heavy` test and per other test.
GUESS_HEAVY_S, GUESS_LIGHT_S = 10.0, 0.3
COSTS = os.path.join(os.path.dirname(__file__), "xdist_costs.json")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Runs a test module's tiny models on one intra-op thread (restored afterwards): on a
    2-core machine, 2 threads on matrices this small are slower, and collapse under load."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    """Keeps the file order that `pytest_collection_modifyitems` sets. WHY: pytest-xdist's
    `--dist loadfile` reorders files by their number of tests before handing them out (its
    `--loadscope-reorder`, on by default), which says nothing of their cost. Same as
    `--no-loadscope-reorder`, without lengthening the README's command."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadfile`, the README's test command) each test file runs
    on one worker, so an expensive module fixture (an exported program, a compiled decoder) is
    built once. WHY files and not `xdist_group` marks with `--dist loadgroup`: on pytest 9.2,
    pytest-xdist 3.8's loadgroup silently stops grouping (it tags node IDs in a field pytest no
    longer reads; pytest-xdist issue #1386), and every worker that ran a fixture's tests built
    it again. Files are handed out in collection order, so the files go longest first (costed by
    their `heavy` and other tests), each keeping its tests' order: the long ones start early and
    the short ones fill in at the end, the longest-processing-time-first rule of scheduling on
    identical machines. A file's cost is its time in the last measured run (`COSTS`; the marks
    misjudge a file whose module fixture serves many `heavy` tests, or whose few light tests
    each run for seconds), else guessed from its marks. Without xdist the order is the files'."""
    if not hasattr(config, "workerinput"):
        return
    guess = collections.Counter()
    for it in items:
        guess[_file_of(it.nodeid)] += GUESS_HEAVY_S if it.get_closest_marker("heavy") else GUESS_LIGHT_S
    cost = merged_costs(guess, _measured_costs())
    items.sort(key=lambda it: -cost[_file_of(it.nodeid)])  # stable: each file's tests stay together, in order


def merged_costs(guess: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """Each file of `guess` at its measured seconds where `measured` has them, else at its guess."""
    return {f: measured.get(f, g) for f, g in guess.items()}


def _measured_costs() -> dict[str, float]:
    """Seconds per test file (node ID path) from `COSTS`; {} where it is missing or unreadable
    (the order then comes from the marks alone: slower, never wrong)."""
    try:
        with open(COSTS, encoding="utf-8") as f:
            costs = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in costs.items() if isinstance(v, (int, float))} if isinstance(costs, dict) else {}


@pytest.fixture(autouse=True, scope="session")
def short_prefixes():
    """Every StaticDecoder in the tests steps over prefixes of the sparse caches in multiples of 4
    slots instead of `state.MIN_PREFIX` (64). WHY: the tests' models hold a few dozen slots per
    expert, so at the default every step would attend the whole cache and no parity check
    (golden, oracle, rollback, speculative, compiled) would run the prefix lengths;
    tests/test_prefix.py checks the default lengths themselves."""
    from shram_static import decoder
    saved = decoder.MIN_PREFIX
    decoder.MIN_PREFIX = 4
    yield
    decoder.MIN_PREFIX = saved
