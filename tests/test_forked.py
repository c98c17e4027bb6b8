"""`shram_static.accelerators.forked.run_jobs`: export jobs in forked processes, and what happens
when a child fails (its job runs again here, with a warning) or this process fails (the child
is stopped)."""

import os
import signal
import time

import pytest

from shram_static.accelerators.forked import can_fork, run_jobs

needs_fork = pytest.mark.skipif(not can_fork(), reason="forked jobs need Linux and two usable CPUs")


def _tag(value):
    return ("sent", value)


def _untag(value):
    assert value[0] == "sent"  # the child's result went through encode, the file and decode
    return value[1]


@needs_fork
def test_first_job_here_the_others_forked_in_order():
    here = os.getpid()
    jobs = {"a": lambda: ("a", os.getpid()), "b": lambda: ("b", os.getpid())}
    out = run_jobs(jobs, _tag, _untag)
    assert list(out) == ["a", "b"]
    assert out["a"] == ("a", here)
    assert out["b"][0] == "b" and out["b"][1] != here


def test_one_process_when_not_parallel_or_a_single_job():
    here = os.getpid()
    jobs = {"a": os.getpid, "b": os.getpid}
    assert run_jobs(jobs, _tag, _untag, parallel=False) == {"a": here, "b": here}
    assert run_jobs({"a": os.getpid}, _tag, _untag) == {"a": here}


def test_one_process_when_the_encoders_accelerator_is_off(monkeypatch):
    """An encoder marked with an accelerator (the edge-program transfer, on ExecuTorch
    internals) is used only where that accelerator is on (shram_static/accelerators/registry.py)."""
    def tag(value):
        return ("sent", value)
    tag.accelerator = "parallel_lowering"
    monkeypatch.setenv("SHRAM_STATIC_STOCK", "parallel_lowering")
    here = os.getpid()
    assert run_jobs({"a": os.getpid, "b": os.getpid}, tag, _untag) == {"a": here, "b": here}


@needs_fork
def test_a_failing_child_is_run_again_here_with_a_warning():
    here = os.getpid()

    def b():
        if os.getpid() != here:
            raise ValueError("boom in the child")
        return "b here"

    with pytest.warns(RuntimeWarning, match=r"process for 'b' failed \(ValueError: boom in the child\)"):
        out = run_jobs({"a": lambda: "a", "b": b}, _tag, _untag)
    assert out == {"a": "a", "b": "b here"}


@needs_fork
@pytest.mark.parametrize("death, why", [(lambda: os._exit(3), "exit code 3"),
                                        (lambda: os.kill(os.getpid(), signal.SIGKILL), "signal 9")])
def test_a_child_that_dies_is_run_again_here(death, why):
    here = os.getpid()

    def b():
        if os.getpid() != here:
            death()
        return "b here"

    with pytest.warns(RuntimeWarning, match=f"process for 'b' failed \\(it died: {why}\\)"):
        assert run_jobs({"a": lambda: "a", "b": b}, _tag, _untag)["b"] == "b here"


@needs_fork
def test_an_error_in_the_job_itself_is_raised_here():
    def b():
        raise KeyError("bad input")

    with pytest.warns(RuntimeWarning, match="failed"), pytest.raises(KeyError, match="bad input"):
        run_jobs({"a": lambda: "a", "b": b}, _tag, _untag)


@needs_fork
def test_an_error_here_stops_the_child(tmp_path):
    pid_file = tmp_path / "child.pid"

    def b():
        pid_file.write_text(str(os.getpid()))
        time.sleep(120)

    def a():
        for _ in range(500):  # until the child has started
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.01)
        raise RuntimeError("lowering failed here")

    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="lowering failed here"):
        run_jobs({"a": a, "b": b}, _tag, _untag)
    assert time.perf_counter() - t < 30
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pid_file.read_text()), 0)
