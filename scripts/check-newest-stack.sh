#!/usr/bin/env bash
# Which torch, ExecuTorch and onnxscript a new user's `pip install -e .` resolves today (pip's dry
# run: nothing is installed), against the releases the accelerators were verified on
# (shram_static/accelerators/registry.py). Exit 0 when all three are verified releases; 1 when
# one is not (its accelerators are off for that user: run the suite on it with
# `TORCH=... scripts/test-newest-stack.sh`, then add it to the registry); 2 when pip failed.
#
#   scripts/check-newest-stack.sh                 # with this machine's pip configuration
#   PIP_CONFIG_FILE=/dev/null PIP_CONSTRAINT= scripts/check-newest-stack.sh --index-url https://pypi.org/simple
#                                                 # what PyPI gives, past a local cap or mirror
#
# Extra arguments go to pip. Needs the network (or the configured index); takes about 30 s.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPORT=$(mktemp)
trap 'rm -f "$REPORT"' EXIT
if ! python -m pip install -q --dry-run --ignore-installed --report "$REPORT" "$@" -e . >/dev/null; then
    echo "pip could not resolve the package's requirements" >&2
    exit 2
fi
python - "$REPORT" <<'PY'
import json
import sys

from shram_static.accelerators import registry  # a leaf module: no torch import

verified = {"torch": registry.TORCH, "executorch": registry.EXECUTORCH, "onnxscript": registry.ONNXSCRIPT}
resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
bad = 0
for dist, releases in verified.items():
    v = resolved.get(dist)
    ok = v is not None and v.split("+")[0] in releases
    bad += not ok
    print(f"{dist:<11} resolves to {v or '(nothing)':<10} verified: {', '.join(releases)}"
          + ("" if ok else "   <- not a verified release: its accelerators are off"))
sys.exit(1 if bad else 0)
PY
