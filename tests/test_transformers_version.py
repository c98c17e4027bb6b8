"""The installed transformers is inside the range pyproject.toml states.

shram_static relies on transformers 5.x internals that moved between releases (generate()'s
`cache` keyword, the cache layer protocol, the generation hooks in shram_static/generation.py):
outside the stated range, this test names the problem before the generate tests fail obscurely.
"""

import os
import re
from importlib.metadata import version

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared() -> Requirement:
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    reqs = [Requirement(s) for s in re.findall(r'^\s*"([^"]+)"', deps, re.M)]
    (req,) = [r for r in reqs if r.name == "transformers"]
    return req


def test_transformers_range_is_stated_and_installed():
    req = _declared()
    assert req.specifier, "pyproject.toml must state the transformers version range the code uses"
    installed = version("transformers")
    assert req.specifier.contains(installed, prereleases=True), (
        f"transformers {installed} is installed, but shram_static supports transformers{req.specifier} "
        f"(pyproject.toml): install a version in that range, e.g. pip install 'transformers{req.specifier}'")
