"""The API reference (docs/api.md) covers every public name, is current, and every public name
has a docstring of its own (scripts/gen_api_docs.py writes the page from them)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_every_public_name_has_a_docstring() -> None:
    missing = gen.undocumented()
    assert not missing, f"public names without a docstring of their own: {missing}"


def test_every_facade_module_declares_its_public_names() -> None:
    import inspect

    bare = []
    for name in gen.public_modules():
        mod = importlib.import_module(name)
        exported = [k for k, v in vars(mod).items()
                    if not k.startswith("_") and not inspect.ismodule(v)
                    and getattr(v, "__module__", "").startswith("ringlet")]
        if exported and not hasattr(mod, "__all__"):
            bare.append(name)
    assert not bare, ("public modules without __all__ (their names would be missing from the "
                      f"docs): {bare}")


def test_api_reference_is_current() -> None:
    text = gen.render()
    assert (ROOT / "docs" / "api.md").read_text() == text, (
        f"docs/api.md is stale; regenerate it with: {gen.COMMAND}")


def test_api_reference_reaches_every_name_from_the_docs_index() -> None:
    """index.md -> api.md (one click) -> the list at its top links every public object (two)."""
    index = (ROOT / "docs" / "index.md").read_text()
    assert "](api.md)" in index, "docs/index.md must link the API reference"
    text = (ROOT / "docs" / "api.md").read_text()
    toc = text.split("\n## ", 2)[1]            # the list of modules and names at the top
    listed = set(re.findall(r"\[`([^`]+)`\]\(#", toc))
    names: dict[int, set[str]] = {}
    for modname in gen.public_modules():
        for name, obj in gen.public_names(importlib.import_module(modname)):
            names.setdefault(id(obj), set()).add(name)
    unlisted = sorted(min(n) for n in names.values() if not n & listed)
    assert not unlisted, f"public names not linked from the top of docs/api.md: {unlisted}"
    assert "### ringlet.distributed.all_reduce\n" in text


def test_environment_section_of_usage_is_current() -> None:
    page = (ROOT / "docs" / "usage.md").read_text()
    assert page == gen.with_env_section(page), (
        "docs/usage.md's environment variables differ from ringlet/_env.py; regenerate with: "
        f"{gen.COMMAND}")


def test_every_environment_variable_is_documented_once() -> None:
    """Each RINGLET_* name the package uses (a string literal) is in ringlet/_env.py's docstring,
    and the docs have one table of them (usage.md), which other pages link to."""
    from ringlet import _env

    used = set()
    for path in (ROOT / "ringlet").rglob("*.py"):
        used |= set(re.findall(r"[\"']((?:RINGLET|TORCH|GLOO|TORCHELASTIC)_[A-Z_]+)[\"']",
                               path.read_text()))
    doc = _env.__doc__ or ""
    undocumented = sorted(v for v in used if v.startswith("RINGLET_") and f"``{v}``" not in doc)
    assert not undocumented, ("environment variables missing from ringlet/_env.py's docstring: "
                              f"{undocumented}")
    tables = [p.name for p in (ROOT / "docs").glob("*.md")
              if re.search(r"^\| `RINGLET_TIMEOUT` \|", p.read_text(), re.MULTILINE)]
    assert tables == ["usage.md"], ("the environment-variable table must live in usage.md only: "
                                    f"{tables}")


def test_every_launcher_flag_is_explained() -> None:
    from ringlet.launcher._plan import build_parser

    bare = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help]
    assert not bare, f"ringlet-run flags without help text (docs/api.md lists them): {bare}"


def test_markdown_conversion_of_a_google_docstring() -> None:
    doc = '''Do a thing.

    Args:
        x: the first
            argument, continued.
        shape, stride: two at once.

    Returns:
        The result, of :class:`~ringlet.mesh.DeviceMesh` kind.

    Example::

        f(1)
    '''
    md = gen.markdown(doc)
    assert "- `x`: the first argument, continued." in md
    assert "- `shape, stride`: two at once." in md
    assert "``DeviceMesh``" in md and "**Returns:**" in md
    assert "```python fragment\nf(1)\n```" in md
