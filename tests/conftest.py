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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command), keeps the tests
    that share an expensive module fixture (an exported program, a compiled decoder) on one
    worker, so each fixture is built once, while every other test is scheduled on its own, the
    `heavy` ones first. Without xdist the marks are inert."""
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        if defs is None:
            continue
        shared = [name for name, fds in defs.name2fixturedefs.items()
                  if name != "one_thread" and any(fd.scope == "module" for fd in fds)]
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{','.join(sorted(shared))}"))
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the schedule's
        # Longest first: xdist hands out the groups (largest first) and then single tests in
        # this order, so the `heavy` ones start early and the short ones fill in at the end,
        # instead of one worker finishing a torchrun or an export while the other waits idle.
        # Only tests without a shared module fixture move (a moved group member would build its
        # fixture twice); without xdist the order is the files'.
        items.sort(key=lambda it: not (it.get_closest_marker("heavy") and not it.get_closest_marker("xdist_group")))
