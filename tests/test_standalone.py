"""The repository stands alone: nothing cites documents that are not in it, and what
docs/architecture.md and docs/reliability.md cite exists.

- No file of the repository (tracked, or new and not ignored) refers to the team's guides that
  live outside it, by name or by a path out of the checkout.
- Every file, ``path.py::name`` and ``tests/...::test_name`` that the two pages cite exists; every
  ``[Note: ...]`` they name is written in the code, in the file the notes table says, and every
  note written in the code has a row in that table.
- Every heading anchor of docs/architecture.md or docs/reliability.md that any file cites is a
  heading of that page, and every row ID cited next to ``docs/reliability.md`` is a row of it.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCH = ROOT / "docs" / "architecture.md"
RELI = ROOT / "docs" / "reliability.md"
_SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "runs", "out", ".pytest_cache",
              ".mypy_cache", ".ruff_cache", ".hypothesis"}

# Written so that this file does not match itself: the guides' names as whole upper-case words
# (with or without ``.md``), and paths that leave the checkout for the team's shared folder.
_OUTSIDE = re.compile(rb"\b(?:DESIG[N]|RELIABILIT[Y]|STYL[E])\b|\.\./share[d]\b|/work/share[d]\b")


def _repo_files() -> list[pathlib.Path]:
    """Tracked files and new ones git does not ignore; without git, a walk of the tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(ROOT).parts)]
    return [ROOT / n for n in sorted(set(names)) if (ROOT / n).is_file()]


def _text_files() -> list[tuple[pathlib.Path, str]]:
    out = []
    for path in _repo_files():
        raw = path.read_bytes()
        if b"\0" not in raw[:8192]:
            out.append((path, raw.decode("utf-8", "replace")))
    return out


def test_no_file_cites_documents_outside_the_repository() -> None:
    bad = []
    for path in _repo_files():
        raw = path.read_bytes()
        if b"\0" in raw[:8192]:
            continue   # binary
        for i, line in enumerate(raw.splitlines(), 1):
            if _OUTSIDE.search(line):
                text = line.decode("utf-8", "replace").strip()[:100]
                bad.append(f"{path.relative_to(ROOT)}:{i}: {text}")
    assert not bad, ("files cite documents outside the repository; point them at "
                     "docs/architecture.md or docs/reliability.md instead:\n" + "\n".join(bad))


# -- what the two pages cite -----------------------------------------------------------------------

_PATH = re.compile(r"`((?:ringlet|tests|scripts|bench|examples|docs)/[\w./-]*?)(?:::([\w.]+))?`")
_BARE = re.compile(r"`(\w+\.py)`")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def _defines(path: pathlib.Path, dotted: str) -> bool:
    """Whether ``path`` defines ``dotted`` (a function or class, ``Class.member`` for a member)."""
    body: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = found.body if isinstance(found, ast.ClassDef) else []
    return True


def _cited(page: pathlib.Path) -> list[str]:
    bad = []
    text = page.read_text()
    basenames = {p.name for p in _repo_files()}
    for m in _PATH.finditer(text):
        rel, name = m[1].rstrip("/"), m[2]
        target = ROOT / rel
        if not target.exists():
            bad.append(f"{m[0]}: no such file")
        elif name and not (target.suffix == ".py" and _defines(target, name)):
            bad.append(f"{m[0]}: {rel} defines no {name}")
    bad += [f"{m[0]}: no file of that name" for m in _BARE.finditer(text) if m[1] not in basenames]
    return bad


def test_files_functions_and_tests_the_pages_cite_exist() -> None:
    bad = _cited(ARCH) + _cited(RELI)
    assert not bad, ("docs/architecture.md / docs/reliability.md cite what does not exist:\n"
                     + "\n".join(bad))


def _note_definitions(files: list[pathlib.Path] | None = None) -> dict[str, set[str]]:
    """Note name -> files of ringlet/ with a line that starts the note (not one that cites it)."""
    defs: dict[str, set[str]] = {}
    for path in files if files is not None else sorted((ROOT / "ringlet").rglob("*.py")):
        for line in path.read_text().splitlines():
            s = line.strip().lstrip("#").strip().removeprefix('"""').strip()
            m = re.match(r"\[Note: ([^\]]+)\](.*)", s)
            if m and not re.match(r"\s*(in\b|lives\b|\)|,|\.|;)", m[2]):
                defs.setdefault(m[1], set()).add(str(path.relative_to(ROOT)))
    return defs


def test_notes_table_lists_every_note_where_it_is_written() -> None:
    defs = _note_definitions()
    rows = dict(re.findall(r"^\| \[Note: ([^\]]+)\] \| `([^`]+)` \|", ARCH.read_text(),
                           re.MULTILINE))
    wrong = [f"[Note: {n}]: the table says {f}, written in {sorted(defs.get(n, ())) or 'no file'}"
             for n, f in rows.items() if f not in defs.get(n, ())]
    # Completeness over the repository's files (work in progress that git does not know yet may
    # add notes before its row); the rows themselves may point at any file on disk.
    known = [p for p in _repo_files()
             if p.suffix == ".py" and p.parts[len(ROOT.parts)] == "ringlet"]
    missing = [f"[Note: {n}] (written in {sorted(fs)})"
               for n, fs in _note_definitions(known).items()
               if n not in rows]
    assert not wrong, "docs/architecture.md's notes table is wrong:\n" + "\n".join(wrong)
    assert not missing, ("notes missing from the table in docs/architecture.md#notes-in-the-code "
                         "(add a row each):\n" + "\n".join(missing))
    for page in (ARCH, RELI):
        prose = re.sub(r"`[^`\n]*`", "", page.read_text())     # not inside code spans
        unknown = sorted(set(_NOTE.findall(prose)) - set(defs))
        assert not unknown, f"{page.name} names notes that no code writes: {unknown}"


# -- anchors and row IDs cited anywhere ---------------------------------------------------------

def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (fenced blocks skipped, repeats numbered)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if m and not fenced:
            base = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_anchors_and_rows_cited_anywhere_exist() -> None:
    anchors = {"architecture.md": _anchors(ARCH), "reliability.md": _anchors(RELI)}
    rows = set(re.findall(r"^\| ([A-Z]\d+) \|", RELI.read_text(), re.MULTILINE))
    bad = []
    for path, text in _text_files():
        for m in re.finditer(r"\b(architecture|reliability)\.md#([\w-]+)", text):
            if m[2] not in anchors[f"{m[1]}.md"]:
                bad.append(f"{path.relative_to(ROOT)}: {m[0]} (no such heading)")
        for line in text.splitlines():
            if "reliability.md" in line:
                for rid in re.findall(r"\brows? ((?:[A-Z]\d+(?:-[A-Z]?\d+)?(?:, | and )?)+)", line):
                    ids = re.findall(r"[A-Z]\d+", rid)
                    bad += [f"{path.relative_to(ROOT)}: row {i} (no such row)"
                            for i in ids if i not in rows]
    assert not bad, ("citations of docs/architecture.md / docs/reliability.md that do not "
                     "resolve:\n"
                     + "\n".join(bad))
