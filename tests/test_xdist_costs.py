"""The measured test-file costs that order the files across pytest-xdist's workers
(tests/xdist_costs.json, `scripts/xdist_costs.py`, read by tests/conftest.py)."""

import json
import os

import conftest
from helpers import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_costs_are_each_files_setup_call_and_teardown_summed():
    """A `--durations=0` report's lines are summed per file, the longest first; other lines
    (a test's own output, the summary) count for nothing."""
    report = "\n".join([
        "============================= slowest durations =============================",
        "12.50s call     tests/test_a.py::test_one[x-1]",
        "3.25s setup    tests/test_b.py::test_two",
        "0.75s teardown tests/test_a.py::test_one[x-1]",
        "1.00s call     tests/test_b.py::Test::test_three",
        "0.01s call     not a node id",
        "0.02s call     tests/test_c.py::test_quick",
        "739 passed, 16 warnings in 224.58s (0:03:44)",
    ])
    assert list(load_script("scripts/xdist_costs.py").file_costs(report).items()) == [("tests/test_a.py", 13.2), ("tests/test_b.py", 4.2)]


def test_the_checked_in_costs_name_test_files_that_exist():
    """Every file tests/xdist_costs.json costs is a test file of the suite, at a positive cost
    (a renamed or deleted file would leave its cost behind, and the new name guessed), and the
    conftest reads the same numbers."""
    with open(conftest.COSTS, encoding="utf-8") as f:
        costs = json.load(f)
    assert costs and all(os.path.isfile(os.path.join(ROOT, name)) for name in costs), costs
    assert all(name.startswith("tests/test_") and cost > 0 for name, cost in costs.items())
    assert conftest._measured_costs() == costs


def test_measured_costs_replace_the_guesses():
    """A measured file is ordered by its seconds alone (not its guess plus them); a file
    without a measurement keeps its guess; a measured file that is not collected is left out."""
    got = conftest.merged_costs({"tests/test_a.py": 150.0, "tests/test_b.py": 0.9},
                              {"tests/test_a.py": 70.0, "tests/test_gone.py": 5.0})
    assert got == {"tests/test_a.py": 70.0, "tests/test_b.py": 0.9}


def test_a_missing_costs_file_leaves_the_guesses(tmp_path, monkeypatch):
    """Without a readable costs file the order comes from the marks alone."""
    monkeypatch.setattr(conftest, "COSTS", str(tmp_path / "none.json"))
    assert conftest._measured_costs() == {}
    (tmp_path / "bad.json").write_text("{not json")
    monkeypatch.setattr(conftest, "COSTS", str(tmp_path / "bad.json"))
    assert conftest._measured_costs() == {}
