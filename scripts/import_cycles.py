"""Report import cycles inside the ringlet package.

Builds the module import graph from the sources (every ``import`` statement, including those
inside functions, which Python resolves late and so hides from an import-time check) and
prints each strongly connected component of more than one module, with the edges that form it
and the line of each import.  A cycle that only a function-level import keeps alive usually
means code sits in the wrong module: the lower module reaches back up for something it should
own or receive.

Run:  python scripts/import_cycles.py [--top-level-only] [--package-edges]

``--top-level-only`` ignores imports inside functions; ``--package-edges`` also counts the
implicit edge from a module to its package ``__init__`` (executed first on import), which makes
every re-exporting ``__init__`` part of a cycle with its children and is off by default.
Exit status 1 when a cycle is found, so the script can guard a CI step.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "ringlet"

Edge = tuple[str, str]


def modules(root: pathlib.Path = ROOT, package: str = PACKAGE) -> dict[str, pathlib.Path]:
    """Module name -> source file for every ``.py`` file under the package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (resolving ``from . import x``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _target(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The longest known module that ``name`` (a module or ``module.attr``) lies in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _nested(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a function (resolved when it runs)."""
    inner = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inner


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the imports under ``if TYPE_CHECKING:`` (never executed)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for b in node.body for n in ast.walk(b)
                    if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def graph(known: dict[str, pathlib.Path], top_level_only: bool = False,
          package_edges: bool = False) -> dict[Edge, list[str]]:
    """(importer, imported) -> the 'path:line (kind)' places that create the edge."""
    edges: dict[Edge, list[str]] = defaultdict(list)
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        inner, typing_only = _nested(tree), _type_checking_only(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in typing_only or (top_level_only and id(node) in inner):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_pkg, node)
                names = [f"{base}.{a.name}" for a in node.names] or [base]
            else:
                continue
            kind = "in a function" if id(node) in inner else "top level"
            for name in names:
                target = _target(name, known)
                place = f"{path.relative_to(ROOT)}:{node.lineno} ({kind})"
                if target and target != module and place not in edges[(module, target)]:
                    edges[(module, target)].append(place)
        if package_edges and "." in module:
            parent = module.rpartition(".")[0]
            if parent in known:
                edges[(module, parent)].append("(package __init__)")
    return edges


def cycles(edges: dict[Edge, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(succ[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-level-only", action="store_true",
                        help="ignore imports inside functions")
    parser.add_argument("--package-edges", action="store_true",
                        help="count the implicit module -> package __init__ edge")
    args = parser.parse_args(argv)
    edges = graph(modules(), args.top_level_only, args.package_edges)
    found = cycles(edges)
    for comp in found:
        members = set(comp)
        print(f"cycle of {len(comp)} modules:")
        for (a, b), where in sorted(edges.items()):
            if a in members and b in members:
                print(f"  {a} -> {b}: {', '.join(where)}")
    print(f"{len(found)} cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
