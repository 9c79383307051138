"""The code blocks of README.md and docs/*.md, as the docs test runs them (pure, no processes).

How a fenced block is marked (its info string, after the three backticks):

- ``python``: runnable.  It must define everything it uses.  A block that calls
  ``init_process_group`` runs under ``ringlet-run`` with ``nproc=N`` processes (default 2,
  e.g. ```` ```python nproc=4 ````), every other one in the test process (threads through
  ``ringlet.testing.run_threads`` are fine).
- ``python fragment``: a signature or a piece of a larger script; it must parse, nothing more.
- ``python file=NAME`` (or any other block with ``file=NAME``): written to ``NAME`` in the page's
  working directory instead of being run directly; a ``console test`` block of the same page
  uses it (``ringlet-run ... NAME``).
- ``console test``: shell commands, run in the page's working directory (a fresh temporary
  directory per page, with the ``file=`` blocks in it and the venv's ``bin`` first on ``PATH``).
  Lines starting with ``$ `` are commands (each must exit 0); the other lines are expected
  output: each must appear in the output, in order; ``...`` in a line stands for any text, a
  line that is only ``...`` for any lines.
- anything else (``console``, ``text``, no info string): shown, not run.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(\s*)```(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: str              # relative to the repository root
    line: int              # line of the opening fence (1-based)
    info: str              # the fence's info string
    code: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def words(self) -> list[str]:
        return self.info.split()

    @property
    def is_python(self) -> bool:
        return self.words[:1] == ["python"]

    @property
    def file(self) -> str | None:
        """``NAME`` of ``file=NAME``: the block is a script that a console block runs."""
        m = re.search(r"\bfile=(\S+)", self.info)
        return m[1] if m else None

    @property
    def runnable(self) -> bool:
        return self.is_python and "fragment" not in self.words and self.file is None

    @property
    def distributed(self) -> bool:
        return "init_process_group" in self.code

    @property
    def nproc(self) -> int:
        m = re.search(r"\bnproc=(\d+)", self.info)
        return int(m[1]) if m else 2

    @property
    def is_console_test(self) -> bool:
        return self.words[:2] == ["console", "test"]

    def commands(self) -> list[tuple[str, list[str]]]:
        """``(command, expected output lines)`` of a console block."""
        out: list[tuple[str, list[str]]] = []
        for line in self.code.splitlines():
            if line.startswith("$ "):
                out.append((line[2:].strip(), []))
            elif out and line.strip():
                out[-1][1].append(line.rstrip())
        return out


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced block of one Markdown file, with its indentation removed."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info, start = len(m[1]), m[2].strip(), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not _FENCE.match(lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        out.append(Block(str(path.relative_to(ROOT)), start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks(p)]


def expected_in_order(expected: list[str], output: str) -> str | None:
    """None if every expected line (``...``: anything) occurs in ``output`` in order, else the
    first line that does not."""
    pos = 0
    for line in expected:
        want = line.strip()
        if want in ("", "..."):
            continue
        pattern = ".*?".join(re.escape(part) for part in want.split("..."))
        found = re.compile(pattern).search(output, pos)
        if found is None:
            return line
        pos = found.end()
    return None


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of a Markdown file (fenced blocks skipped; repeats get -1, -2)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if m and not fenced:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out
