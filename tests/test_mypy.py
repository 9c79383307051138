"""The package passes ``mypy`` with the repository's configuration (pyproject.toml [tool.mypy]), as
tests/test_lint.py holds it to ``ruff check``.

mypy keeps its cache in the repository's ``.mypy_cache`` (ignored by git), so a run after the
first rechecks only what changed: about 1 s, against 15-35 s for a cold run on a loaded 2-core
machine. Without mypy installed (it comes with the dev extra) the tests skip."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    if proc.returncode not in (0, 1):
        raise AssertionError(f"mypy failed to run (exit {proc.returncode}): {proc.stderr}")
    return proc


def _errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in proc.stdout.splitlines() if re.search(r":\d+: error:", ln)]


@pytest.mark.timeout(300)
def test_mypy_is_clean_with_the_repository_config() -> None:
    errors = _errors(_mypy("ringlet"))
    assert not errors, f"mypy finds {len(errors)} errors:\n" + "\n".join(errors)


@pytest.mark.timeout(300)
def test_group_and_mesh_arguments_are_checked() -> None:
    """The public boundaries are typed (not ``Any``): mypy, with the same configuration, refuses
    a group given as a string and a mesh given as a list."""
    probe = ("import torch\n"
             "import ringlet.distributed as dist\n"
             "from ringlet.distributed.fsdp import fully_shard\n"
             "dist.all_reduce(torch.ones(1), group='world')\n"
             "fully_shard(torch.nn.Linear(2, 2), mesh=[0, 1])\n")
    errors = [e for e in _errors(_mypy("-c", probe)) if e.startswith("<string>:")]
    assert len(errors) == 2 and all("[arg-type]" in e for e in errors), errors
    assert '"group"' in errors[0] and '"mesh"' in errors[1], errors


def test_mypy_comes_with_the_dev_extra() -> None:
    """CI installs ``.[dev]`` and runs the suite: mypy must be among what that installs."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = config["project"]["optional-dependencies"]["dev"]
    assert any(re.fullmatch(r"mypy\b.*", d) for d in dev), f"add mypy to the dev extra: {dev}"


def test_an_ignore_without_its_error_code_is_refused() -> None:
    """``# type: ignore`` must name what it silences (``# type: ignore[attr-defined]``), so that
    it cannot hide a second, unrelated error on the same line."""
    errors = _errors(_mypy("-c", "x: int = 'a'  # type: ignore\n"))
    assert len(errors) == 1 and "[ignore-without-code]" in errors[0], errors
