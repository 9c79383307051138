"""The benchmarks share one command line and one launch (bench/_common.py), and no two bench
modules import each other (a benchmark's pieces read one way: script -> its helpers)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.timeout(120)


def _common():
    spec = importlib.util.spec_from_file_location("_bench_common", BENCH / "_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_imports(path: pathlib.Path) -> set[str]:
    """The bench modules ``path`` imports (anywhere in it, functions included)."""
    local = {p.stem for p in BENCH.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found & local - {path.stem}


def test_no_two_bench_modules_import_each_other() -> None:
    graph = {p.stem: _bench_imports(p) for p in BENCH.glob("*.py")}
    both = sorted((a, b) for a, deps in graph.items() for b in deps
                  if a < b and a in graph.get(b, set()))
    assert both == []


def test_the_shared_command_line() -> None:
    common = _common()
    p = common.parser("Title line.\n\nMore text.", op_timeout=30.0)
    a = p.parse_args(["--ranks", "3", "--markdown", "out.md"])
    assert (a.ranks, a.markdown, a.op_timeout, a.timeout) == (3, "out.md", 30.0, None)
    assert p.description == "Title line."
    bare = common.parser(None, ranks=None).parse_args([])
    assert vars(bare) == {"markdown": None}
    assert common.names(" a, b,", "--ops", ("a", "b", "c")) == ("a", "b")
    for bad in ("a,x", " , "):
        with pytest.raises(ValueError, match=r"expected --ops from a,b,c, got"):
            common.names(bad, "--ops", ("a", "b", "c"))


def test_a_bad_value_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    common = _common()
    p = common.parser("t", ranks=None)
    p.add_argument("--ops", default="a")
    with pytest.raises(SystemExit) as exit_:
        common.parse(p, ["--ops", "zz"], lambda a: common.names(a.ops, "--ops", ("a",)))
    assert exit_.value.code == 2
    assert "expected --ops from a, got 'zz'" in capsys.readouterr().err
    assert common.parse(p, [], lambda a: a.ops) == "a"


def test_preamble_names_the_command_machine_and_setup() -> None:
    common = _common()
    info = {"date": "D", "nproc": "2", "cpu": "C", "os": "O", "torch": "T", "python": "P"}
    text = common.preamble("title", ["setup: s"], info, markdown=False)
    assert text.splitlines()[1:] == ["date: D", "machine: nproc 2; C; O",
                                     "software: torch T, python P", "setup: s"]
    md = common.preamble("title", ["setup: s"], info, markdown=True)
    assert md.startswith("# title\n\n- command: `python ") and md.endswith("- setup: s\n")


@pytest.mark.parametrize("script", ["collectives", "waits"])
def test_a_script_parses_through_the_shared_parser(script: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--ops", "nope"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 2
    assert "expected --ops from" in out.stderr
