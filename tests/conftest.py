"""Test-wide settings, and the order of the test files under pytest-xdist."""

import collections
import json
import pathlib

import pytest
import torch

# Each test file's seconds (setup, call and teardown of its tests, summed), written by a run with
# `--write-durations`: under xdist the longest files are handed out first.
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
# A file missing from DURATIONS (a new one) is costed from its marks: seconds per test.
GUESS_HEAVY_S, GUESS_LIGHT_S = 10.0, 0.3
_SPENT: collections.Counter = collections.Counter()  # this process's seconds per file


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Runs a test module's tiny models on one intra-op thread (restored afterwards): on a
    2-core machine, 2 threads on matrices this small are slower, and collapse under load."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_addoption(parser):
    parser.addoption("--write-durations", action="store_true",
                     help=f"write the seconds of each test file this run ran to tests/{DURATIONS.name}")


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
    it again. Files are handed out in collection order, so the files go longest first (their
    seconds in DURATIONS; a file not there by its `heavy` and other tests), each keeping its
    tests' order: the long ones start early and the short ones fill in at the end, the longest
    processing time first rule of scheduling on identical machines. Without xdist the order is
    the files'."""
    if not hasattr(config, "workerinput"):
        return
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    guess = collections.Counter()
    for it in items:
        guess[_file_of(it.nodeid)] += GUESS_HEAVY_S if it.get_closest_marker("heavy") else GUESS_LIGHT_S
    cost = {f: known.get(f, g) for f, g in guess.items()}
    items.sort(key=lambda it: -cost[_file_of(it.nodeid)])  # stable: each file's tests stay together, in order


def pytest_runtest_logreport(report):
    """Adds up each file's seconds for `--write-durations` (on xdist's controller too)."""
    _SPENT[_file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session):
    """`--write-durations`: the files this run ran get their new seconds; files it did not run
    keep theirs, and files that are gone are dropped."""
    if session.config.getoption("write_durations") and not hasattr(session.config, "workerinput"):
        root = session.config.rootpath
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        known.update((f, round(s, 1)) for f, s in _SPENT.items())
        DURATIONS.write_text(json.dumps({f: s for f, s in sorted(known.items()) if (root / f).is_file()},
                                        indent=1) + "\n")


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
