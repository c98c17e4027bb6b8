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
