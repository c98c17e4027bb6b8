"""Test-wide settings."""

import pytest
import torch


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
    `--loadscope-reorder`, on by default), which sends the few-test heavy files (a stock
    lowering, a two-process training run) last, onto a worker that is still busy: the whole
    suite took 287-290 s that way against 270 s in the order below, on the 2-core CI machine.
    Same as `--no-loadscope-reorder`, without lengthening the README's command."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadfile`, the README's test command) each test file runs
    on one worker, so an expensive module fixture (an exported program, a compiled decoder) is
    built once. WHY files and not `xdist_group` marks with `--dist loadgroup`: on pytest 9.2,
    pytest-xdist 3.8's loadgroup silently stops grouping (it tags node IDs in a field pytest no
    longer reads; pytest-xdist issue #1386), and every worker that ran a fixture's tests built
    it again (the suite took ~10% longer). Files are handed out in collection order, so the
    `heavy` tests that share no module fixture go first: their files start early and the short
    ones fill in at the end. A test that shares one keeps its place (moved apart from its
    file's other users, it would build the fixture twice). Without xdist the order is the files'."""
    if not hasattr(config, "workerinput"):
        return

    def shares_a_module_fixture(item) -> bool:
        defs = getattr(item, "_fixtureinfo", None)
        return defs is not None and any(
            name != "one_thread" and any(fd.scope == "module" for fd in fds)
            for name, fds in defs.name2fixturedefs.items())

    items.sort(key=lambda it: not (it.get_closest_marker("heavy") and not shares_a_module_fixture(it)))


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
