#!/usr/bin/env bash
# Which torch, ExecuTorch and onnxscript a new user's `pip install -e .` resolves today (pip's dry
# run: nothing is installed), against the releases the accelerators were verified on
# (each accelerator's in shram_static/accelerators/registry.py). Exit 0 when every accelerator
# would run; 1 when one would be off (it is listed: run the suite on that release with
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

from shram_static.accelerators.registry import REGISTRY  # a leaf module: no torch import

resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"].split("+", 1)[0]
            for i in json.load(open(sys.argv[1]))["install"]}
for dist in sorted({d for a in REGISTRY.values() for d in a.verified}):
    print(f"{dist:<11} resolves to {resolved.get(dist, '(nothing)')}")
# each accelerator whose packages are not all at a release it was verified on: off for that install
off = {name: [f"{d} {resolved.get(d)}" for d, ok in a.verified.items() if resolved.get(d) not in ok]
       for name, a in REGISTRY.items()}
for name, why in off.items():
    if why:
        print(f"off for that install: {name} ({', '.join(why)} not verified)")
sys.exit(1 if any(off.values()) else 0)
PY
