"""The package's layout rules (docs/design.md, "The package at a glance"), read from its source:
modules under 450 lines, private torch/ExecuTorch internals named only in `accelerators/` (and
one Inductor option module), the accelerators reached through their package's seam only, and
the backend names spelled in `backends.py` alone."""

import pathlib
import re

from shram_static.backends import BACKENDS

PKG = pathlib.Path(__file__).resolve().parent.parent / "shram_static"
MODULES = sorted(PKG.rglob("*.py"))
OUTSIDE = [p for p in MODULES if "accelerators" not in p.relative_to(PKG).parts]
# `decoder.py` reads `torch._inductor.config.cpp` to tell whether a public option exists
PRIVATE_ALLOWED = {"decoder.py"}
PRIVATE = re.compile(r"\b(torch|executorch)(\.\w+)*\._[a-z]\w*"  # a private module or attribute
                     r"|from (torch|executorch)[\w.]* import [^\n]*\b_[a-z]\w*")  # a private name imported


def _code(path: pathlib.Path) -> str:
    """The module's text without comments (a comment may name what it explains)."""
    return "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())


def _unquoted(text: str) -> str:
    """`text` without its one-line string literals (a logger's name is no internal)."""
    return re.sub(r"\"[^\"\n]*\"|'[^'\n]*'", "", text)


def test_no_module_over_450_lines():
    long = {str(p.relative_to(PKG)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_private_internals_are_named_only_in_the_accelerators():
    named = {str(p.relative_to(PKG)) for p in OUTSIDE if PRIVATE.search(_unquoted(_code(p)))}
    assert named <= PRIVATE_ALLOWED, sorted(named - PRIVATE_ALLOWED)


def test_the_accelerators_are_reached_through_their_seam():
    inner = re.compile(r"accelerators\.(?!__init__)[a-z_]+\b(?=\s+import)|from \.+accelerators\.[a-z_]+ import")
    through = {str(p.relative_to(PKG)) for p in OUTSIDE if inner.search(_code(p))}
    assert not through, through


def test_backend_names_are_spelled_in_backends_py_only():
    quoted = re.compile("|".join(rf"[\"']{re.escape(b)}[\"']" for b in BACKENDS if "-" in b))
    spelled = {str(p.relative_to(PKG)) for p in OUTSIDE if p.name != "backends.py" and quoted.search(_code(p))}
    assert not spelled, spelled
