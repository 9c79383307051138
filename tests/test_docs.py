"""The documentation runs: every runnable Python block of README.md and docs/*.md (see
``docblocks.py`` for how blocks are marked) on threads in this process or on real processes under
``ringlet-run``, every ``console test`` block's commands; every Python block parses; links between
docs (files and anchors) and the ``docs/*.md`` that code mentions exist."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from docblocks import ROOT, Block, all_blocks, anchors, blocks, doc_files, expected_in_order

BLOCKS = all_blocks()
LOCAL = [b for b in BLOCKS if b.runnable and not b.distributed]
GROUPS = sorted({b.nproc for b in BLOCKS if b.runnable and b.distributed})
CONSOLE_DOCS = sorted({b.path for b in BLOCKS if b.is_console_test})
ENV = {**os.environ, "RINGLET_TIMEOUT": "30", "OMP_NUM_THREADS": "1",
       "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.is_python], ids=lambda b: b.where)
def test_python_blocks_parse(block: Block) -> None:
    compile(block.code, block.where, "exec")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", LOCAL, ids=lambda b: b.where)
def test_local_blocks_run(block: Block, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)          # blocks may write files (torch.save(..., "opt.pt"))
    exec(compile(block.code, block.where, "exec"), {"__name__": "__main__"})  # noqa: S102 - running the docs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", GROUPS)
def test_distributed_blocks_run_under_the_launcher(nproc: int, tmp_path) -> None:
    todo = [{"where": b.where, "code": b.code} for b in BLOCKS
            if b.runnable and b.distributed and b.nproc == nproc]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(todo))
    proc = subprocess.run([sys.executable, "-m", "ringlet.distributed.run",
                           "--nproc-per-node", str(nproc),
                           str(ROOT / "tests" / "_docs_runner.py"), str(spec)],
                          capture_output=True, text=True, timeout=220, env=ENV, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for item in todo:
        assert out.count(f"DOC BLOCK OK: {item['where']}") == nproc, out[-6000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("doc", CONSOLE_DOCS)
def test_console_blocks_run(doc: str, tmp_path) -> None:
    page = blocks(ROOT / doc)
    for b in page:
        if b.file:
            (tmp_path / b.file).write_text(b.code)
    for b in (b for b in page if b.is_console_test):
        for command, expected in b.commands():
            proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                  timeout=200, env=ENV, cwd=tmp_path)
            out = proc.stdout + proc.stderr
            assert proc.returncode == 0, (f"{b.where}: `{command}` exited "
                                          f"{proc.returncode}:\n{out[-6000:]}")
            missing = expected_in_order(expected, out)
            assert missing is None, (f"{b.where}: `{command}` did not print "
                                     f"{missing!r}:\n{out[-6000:]}")


def test_every_script_block_is_run_by_a_console_block() -> None:
    unrun = [b.where for b in BLOCKS if b.file and not any(
        c.path == b.path and b.file in c.code for c in BLOCKS if c.is_console_test)]
    assert not unrun, f"python file=NAME blocks that no console test block runs: {unrun}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: pathlib.Path) -> None:
    """Links to files that exist and, with a #fragment into a Markdown page, to a heading of it."""
    bad = []
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)   # not inside code blocks
    for m in _LINK.finditer(text):
        target, _, frag = m[1].partition("#")
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (doc.parent / target) if target else doc
        if not path.exists():
            bad.append(f"{m[1]} (no such file)")
        elif frag and path.suffix == ".md" and frag not in anchors(path):
            bad.append(f"{m[1]} (no heading '#{frag}' in {path.name})")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links: {bad}"


def test_docs_named_in_code_exist() -> None:
    """Every page of docs/ that a comment, docstring or message of the code names exists."""
    missing = set()
    for folder in ("ringlet", "tests", "scripts", "examples", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"\bdocs/([\w-]+\.md)", path.read_text(errors="replace")):
                if not (ROOT / "docs" / name).exists():
                    missing.add(f"{path.relative_to(ROOT)}: docs/{name}")
    assert not missing, f"pages named in code that do not exist: {sorted(missing)}"
