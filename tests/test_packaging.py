"""What the package says about itself is true: version, supported Python and torch."""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

import pytest
import torch

import ringlet
from ringlet._version import TORCH_MAX_EXCLUSIVE, TORCH_MIN, check_torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_comes_from_the_package_metadata() -> None:
    assert ringlet.__version__ == PYPROJECT["version"]


def test_torch_range_matches_pyproject_and_this_torch_is_in_it() -> None:
    lo = ".".join(map(str, TORCH_MIN))
    hi = ".".join(map(str, TORCH_MAX_EXCLUSIVE[:1]))
    assert f"torch>={lo},<{hi}" in PYPROJECT["dependencies"]
    check_torch(torch.__version__)


@pytest.mark.parametrize("version", ["2.3.1", "1.13.0+cpu", "3.0.0", "garbage"])
def test_unsupported_torch_is_refused_with_both_versions(version: str) -> None:
    with pytest.raises(ImportError, match=re.escape(f"this environment has torch {version}")):
        check_torch(version)


def test_python_requirement_is_the_one_the_readme_states_and_this_python_meets_it() -> None:
    spec = PYPROJECT["requires-python"]
    m = re.fullmatch(r">=(\d+)\.(\d+)", spec)
    assert m, spec
    need = (int(m[1]), int(m[2]))
    assert sys.version_info[:2] >= need
    readme = (ROOT / "README.md").read_text()
    assert f"Python {need[0]}.{need[1]}+" in readme
    for older in range(8, need[1]):
        assert f"Python 3.{older}+" not in readme
