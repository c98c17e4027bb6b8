#!/usr/bin/env bash
# The test suite on one supported torch/ExecuTorch pair, in a virtual environment of its own:
# by default torch 2.14.1 + ExecuTorch 1.5.1, and the newest releases of everything
# else, as `pip install -e ".[test]"` resolves them for a new user.
#
#   scripts/test-newest-stack.sh            # venv in .venv-newest (reused if present)
#   VENV=/tmp/v scripts/test-newest-stack.sh -k export   # extra args go to pytest
#   TORCH=2.13.0 EXECUTORCH=1.4.1 VENV=.venv-oldest scripts/test-newest-stack.sh   # the oldest pair
#   TORCH=2.15.0 VENV=.venv-2.15 scripts/test-newest-stack.sh   # the newest torch (where pip serves it)
#
# TORCH_INDEX=<url> takes torch from another index (e.g. a CPU-only wheel index); without it pip
# takes the registry's default build of torch $TORCH (a CUDA build of several GB on Linux).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv-newest}
TORCH=${TORCH:-2.14.1}
EXECUTORCH=${EXECUTORCH:-1.5.1}
if [ ! -x "$VENV/bin/python" ]; then
    python -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q -U pip
if [ -n "${TORCH_INDEX:-}" ]; then
    "$PY" -m pip install -q "torch==$TORCH" --index-url "$TORCH_INDEX"
fi
"$PY" -m pip install -q "torch==$TORCH" "executorch==$EXECUTORCH" -e ".[test]"
TEST_DEPS=$("$PY" -c 'import importlib.metadata as m, re
print(" ".join(re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in m.requires("shram_static") or [] if "extra == \"test\"" in r))')
"$PY" -m pip install -q -U $TEST_DEPS
"$PY" -c "import torch, executorch, importlib.metadata as m; print('torch', torch.__version__, 'executorch', m.version('executorch'))"
# PATH: the suite runs `shram-static` and `python` in subprocesses; they must be this venv's.
PATH="$(cd "$VENV/bin" && pwd):$PATH" "$PY" -m pytest -q -n 2 --dist loadfile "$@"
