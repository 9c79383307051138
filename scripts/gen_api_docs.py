"""Write docs/api.md, the API reference, from the docstrings of ringlet's public modules, and
the environment-variable section of docs/usage.md from ``ringlet/_env.py``'s docstring.

The public modules are those that mirror torch's paths (``ringlet.distributed`` and every
non-private module below it, ``ringlet.nn``, ``ringlet.utils``) plus ``ringlet.testing`` and
``ringlet.ft`` (fault tolerance, which torch does not have); a
module's public names are its ``__all__``.  Each object is described once, under the first
module (shallowest first) that exports it; other modules that re-export it link there.

    .venv/bin/python scripts/gen_api_docs.py            # rewrite what is stale
    .venv/bin/python scripts/gen_api_docs.py --check    # exit 1 if a page is stale

``tests/test_api_docs.py`` runs the check and requires a docstring on every public name.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import pathlib
import pkgutil
import re
import sys
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
PACKAGES = ("ringlet.distributed", "ringlet.nn", "ringlet.utils", "ringlet.testing", "ringlet.ft")
COMMAND = ".venv/bin/python scripts/gen_api_docs.py"
_SECTION = re.compile(r"^(Args|Arguments|Keyword Args|Returns|Yields|Raises|Attributes|Note|Notes|"
                      r"Example|Examples|Warning|Warnings)s?:\s*$")
_ITEM = re.compile(r"^(\*{0,2}[\w.]+(?:, \*{0,2}[\w.]+)*(?: \([^)]*\))?):\s*(.*)$")
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|obj|data|exc):`(?:~[\w.]*\.)?([^`]+)`")


# -- what is public --------------------------------------------------------------------------
def public_modules() -> list[str]:
    """Every public module of PACKAGES, shallowest first (the order of the page)."""
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                names.append(info.name)
    return sorted(set(names), key=lambda n: (PACKAGES.index(_package(n)), n.count("."), n))


def _package(name: str) -> str:
    return next(p for p in PACKAGES if name == p or name.startswith(p + "."))


def public_names(module: Any) -> list[tuple[str, Any]]:
    """``(name, object)`` for each name of ``__all__`` that is not a module."""
    out = []
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if not inspect.ismodule(obj):
            out.append((name, obj))
    return out


def own_doc(obj: Any) -> str | None:
    """The object's own docstring: not one inherited from a base class, not the signature line
    that ``dataclasses`` writes for an undocumented class; None for plain values."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        if doc and doc.startswith(obj.__name__ + "("):
            return None
        return doc
    if callable(obj):
        return getattr(obj, "__doc__", None)
    return None


def is_value(obj: Any) -> bool:
    return not (inspect.isclass(obj) or callable(obj))


def undocumented() -> list[str]:
    """Public names (of every public module) whose object has no docstring of its own."""
    missing = []
    for modname in public_modules():
        for name, obj in public_names(importlib.import_module(modname)):
            if not is_value(obj) and not (own_doc(obj) or "").strip():
                missing.append(f"{modname}.{name}")
    return missing


# -- formatting ------------------------------------------------------------------------------
def _default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        owner = "ReduceOp" if type(value).__name__ == "RedOpType" else type(value).__name__
        return f"{owner}.{value.name}"
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__qualname__
    text = repr(value)
    return "..." if " at 0x" in text else text


def signature(obj: Any, name: str) -> str | None:
    """``name(a, b=1, *, c=None)`` without annotations; None where Python cannot tell."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    parts, star_done = [], False
    for k, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
            continue
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        text = ("**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if p.default is not p.empty:
            text += f"={_default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (k + 1 == len(params)
                                            or params[k + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return f"{name}({', '.join(parts)})"


def _code_block(lines: list[str]) -> list[str]:
    text = inspect.cleandoc("\n".join(lines))
    try:
        compile(text, "<docstring>", "exec")
        info = "python fragment"
    except SyntaxError:
        info = "text"
    return [f"```{info}", *text.splitlines(), "```"]


def markdown(doc: str) -> str:
    """A Google-style docstring as Markdown: sections in bold, their items as a list, ``::``
    blocks as fenced code, reST roles as code."""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = _ROLE.sub(lambda m: f"``{m[1]}``", lines[i])
        m = _SECTION.match(line.strip()) if not line.startswith(" ") else None
        if m:
            block, i = _indented(lines, i + 1)
            out += ["", f"**{m[1]}:**", ""]
            if m[1].startswith("Example"):
                out += _code_block(block)
            elif m[1] in ("Args", "Arguments", "Keyword Args", "Raises", "Attributes"):
                out += _items(block)
            else:
                out += [_ROLE.sub(lambda r: f"``{r[1]}``", line) for line in inspect.cleandoc(
                    "\n".join(block)).splitlines()]
            out.append("")
            continue
        if line.rstrip().endswith("::") and i + 1 < len(lines):
            block, j = _indented(lines, i + 1)
            if block:
                out.append(line.rstrip()[:-1])
                out += ["", *_code_block(block), ""]
                i = j
                continue
        out.append(line)
        i += 1
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def _indented(lines: list[str], i: int) -> tuple[list[str], int]:
    """The indented block starting at ``lines[i]`` (blank lines inside it kept)."""
    block = []
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
    return block, i


def _items(block: list[str]) -> list[str]:
    """Section lines ``name: text`` (continued on deeper lines) as a Markdown list."""
    text = inspect.cleandoc("\n".join(block)).splitlines()
    items: list[str] = []
    for line in text:
        if not line.strip():
            continue
        line = _ROLE.sub(lambda m: f"``{m[1]}``", line)
        m = _ITEM.match(line)
        if m and not line.startswith(" "):
            items.append(f"- `{m[1]}`: {m[2]}")
        elif items:
            items[-1] += " " + line.strip()      # a continuation line
        else:
            items.append(f"- {line.strip()}")
    return items


def slug(heading: str, used: dict[str, int]) -> str:
    """GitHub's anchor for a heading (lower case, punctuation dropped, a suffix when repeated)."""
    base = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    n = used.get(base, 0)
    used[base] = n + 1
    return base if n == 0 else f"{base}-{n}"


# -- the page ----------------------------------------------------------------------------------
class Page:
    def __init__(self) -> None:
        self.used: dict[str, int] = {}
        self.home: dict[int, tuple[str, str]] = {}     # id(obj) -> (dotted name, anchor)
        self.body: list[str] = []
        self.toc: list[str] = []

    def heading(self, level: int, text: str) -> str:
        anchor = slug(text, self.used)
        self.body += [f"{'#' * level} {text}", ""]
        return anchor

    def module(self, modname: str) -> None:
        mod = importlib.import_module(modname)
        anchor = self.heading(2, modname)
        doc = (mod.__doc__ or "").strip()
        if doc:
            self.body += [markdown(doc.split("\n\n")[0]), ""]
        names, refs = [], []
        for name, obj in public_names(mod):
            seen = self.home.get(id(obj))
            if seen is not None and not is_value(obj):
                refs.append(f"[`{name}`](#{seen[1]})" + ("" if seen[0].endswith("." + name)
                                                          else f" (`{seen[0]}`)"))
                continue
            names.append(f"[`{name}`](#{self.entry(modname, name, obj)})")
        if refs:
            self.body += ["Also here, described where first listed: " + ", ".join(refs) + ".", ""]
        self.toc.append(f"- [{modname}](#{anchor})" + (": " + ", ".join(names) if names else ""))

    def entry(self, modname: str, name: str, obj: Any) -> str:
        dotted = f"{modname}.{name}"
        anchor = self.heading(3, dotted)
        if not is_value(obj):
            self.home[id(obj)] = (dotted, anchor)
        sig = None if is_value(obj) else signature(obj, name)
        kind = "class" if inspect.isclass(obj) else None
        if is_value(obj):
            self.body += [f"`{name} = {_default(obj)}`", ""]
        elif sig:
            self.body += [f"`{kind + ' ' if kind else ''}{sig}`", ""]
        doc = own_doc(obj)
        if doc:
            self.body += [markdown(doc), ""]
        if inspect.isclass(obj):
            self.methods(obj)
        return anchor

    def methods(self, cls: type) -> None:
        for name, fn, is_property in _own_methods(cls):
            sig = f"{name}" if is_property else _bound(signature(fn, name) or name)
            sig += " (property)" if is_property else ""
            doc = (inspect.getdoc(fn) or "").strip()
            first = markdown(doc) if doc else ""
            self.body += [f"- `{sig}`" + (":" if first else "")]
            if first:
                self.body += ["", _indent(first), ""]
        if self.body[-1] != "":
            self.body.append("")


def _own_methods(cls: type) -> Iterator[tuple[str, Any, bool]]:
    """Public methods and properties that ringlet defines on ``cls`` or its ringlet bases."""
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("ringlet"):
            continue
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
            if isinstance(attr, property):
                fn = attr.fget
            if callable(fn) and not inspect.isclass(fn):
                seen.add(name)
                yield name, fn, isinstance(attr, property)


def _bound(sig: str) -> str:
    """A method's signature without its ``self``/``cls``."""
    return re.sub(r"^(\w+)\((?:self|cls)(?:, |(?=\)))", r"\1(", sig)


def _indent(text: str) -> str:
    return "\n".join(("  " + line) if line else "" for line in text.splitlines())


def launcher_flags() -> list[str]:
    """``ringlet-run``'s flags as a Markdown table, from its argument parser (the same text as
    ``--help``, independent of the Python version's help layout)."""
    from ringlet.launcher._plan import build_parser

    rows = ["| flag | meaning |", "|---|---|"]
    for action in build_parser()._actions:
        if not action.option_strings or action.help == "==SUPPRESS==":
            continue
        meta = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
        flags = ", ".join(f"`{o}{meta}`" for o in action.option_strings)
        meaning = (action.help or "").replace("|", "\\|").replace("<", "&lt;")
        if action.choices:
            meaning += f" (one of {', '.join(map(str, action.choices))})"
        rows.append(f"| {flags} | {meaning} |")
    return rows


ENV_DOC = ROOT / "docs" / "usage.md"
ENV_BEGIN = ("<!-- generated from the docstring of ringlet/_env.py by scripts/gen_api_docs.py: "
             "edit it there -->")
ENV_END = "<!-- end of the generated section -->"


def env_section() -> str:
    """The environment-variable tables of ``ringlet/_env.py``'s docstring, as Markdown."""
    from ringlet import _env

    body = inspect.cleandoc(_env.__doc__ or "").split("\n\n", 1)[1]
    # A table row too long for one source line continues on lines indented by two spaces.
    body = re.sub(r"\n  +(?=\S)", " ", body)
    body = re.sub(r"``([^`]+)``", r"`\1`", body)
    body = body.replace("docs/security.md", "[security.md](security.md)")
    intro = ("Every `RINGLET_*` variable is read in one module, `ringlet/_env.py`, and documented "
             "in its docstring, from which this section is generated.")
    return f"{ENV_BEGIN}\n\n{intro}\n\n{body.strip()}\n\n{ENV_END}"


def with_env_section(page: str) -> str:
    """``page`` (docs/usage.md) with its generated section replaced by the current one."""
    begin, end = page.find(ENV_BEGIN), page.find(ENV_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{ENV_DOC}: expected the markers {ENV_BEGIN!r} ... {ENV_END!r}")
    return page[:begin] + env_section() + page[end + len(ENV_END):]


TOC_LINES = 150          # pages longer than this get a table of contents


def with_toc(page: str) -> str:
    """``page`` with a ``## Contents`` list of its ``##`` sections (inserted before the first
    one, or refreshed) if it is longer than TOC_LINES; otherwise unchanged."""
    if len(page.splitlines()) <= TOC_LINES:
        return page
    heads, fenced = [], False
    for line in page.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## ") and line != "## Contents":
            heads.append(line[3:].strip())
    used: dict[str, int] = {}
    slug("contents", used)
    items = [f"- [{h}](#{slug(h, used)})" for h in heads]
    toc = "## Contents\n\n" + "\n".join(items) + "\n\n"
    old = re.search(r"^## Contents\n\n(?:- .*\n)*\n", page, re.MULTILINE)
    if old:
        return page[:old.start()] + toc + page[old.end():]
    first = re.search(r"^## ", page, re.MULTILINE)
    return page if first is None else page[:first.start()] + toc + page[first.start():]


def doc_pages() -> list[pathlib.Path]:
    """The guides that get a table of contents (not the generated reference, not the index)."""
    return [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in ("api.md", "index.md")]


def render() -> str:
    page = Page()
    for modname in public_modules():
        page.module(modname)
    page.body += ["## ringlet-run", "", ("`ringlet-run [flags] script [args...]` (also `python -m "
                  "ringlet.distributed.run`); the flags (`ringlet-run --help`):"), "",
                  *launcher_flags(), ""]
    head = [
        "# API reference",
        "",
        (f"Generated from the docstrings by `scripts/gen_api_docs.py`: do not edit by hand, run "
         f"`{COMMAND}`. Every public name of the modules that mirror torch's paths (`torch` -> "
         "`ringlet`) and of `ringlet.testing` and `ringlet.ft`; each object is described under the "
         "first module "
         "that exports it, and the other modules link there. Guides: [index.md](index.md)."),
        "",
        "## Modules and their names",
        "",
        *page.toc,
        "- [ringlet-run](#ringlet-run): the launcher's flags",
        "",
    ]
    return "\n".join(head + page.body).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not current")
    args = ap.parse_args(argv)
    pages = {path: with_toc(path.read_text()) for path in doc_pages()}
    pages[ENV_DOC] = with_toc(with_env_section(ENV_DOC.read_text()))
    pages[OUT] = render()
    stale = [path for path, text in pages.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
