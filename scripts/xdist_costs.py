"""Measures each test file's seconds and writes tests/xdist_costs.json, which tests/conftest.py
reads to hand the files to pytest-xdist's workers longest first.

Runs the README's test command with `--durations=0` and sums each file's setup, call and
teardown times (pytest leaves out those under 5 ms). Extra arguments go to pytest. Re-run it
after adding or reshaping a slow test file: a stale or missing entry only makes the order worse,
never a test wrong.

    python scripts/xdist_costs.py [PYTEST_ARGS...]
"""

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "xdist_costs.json"
LINE = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+?)::")


def file_costs(report: str) -> dict[str, float]:
    """Seconds per test file (its node ID path) from a `--durations=0` report.

    Args:
        report: pytest's terminal output.

    Returns:
        {file: seconds, rounded to 0.1}, the longest first; a file of under 0.05 s is left out
        (the conftest guesses its cost from its marks).
    """
    total: collections.Counter = collections.Counter()
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            total[m.group(2)] += float(m.group(1))
    return {f: round(s, 1) for f, s in total.most_common() if round(s, 1) > 0}


def main(argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--durations=0", *argv]
    print("running:", " ".join(cmd), file=sys.stderr)
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        print(f"pytest exited with {run.returncode}: {OUT} left as it was", file=sys.stderr)
        return 1
    costs = file_costs(run.stdout)
    OUT.write_text(json.dumps(costs, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: {len(costs)} files, {sum(costs.values()):.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
