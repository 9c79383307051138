"""Nested state dicts <-> flat ``{key: leaf}`` maps, and the JSON encoding of plain values.

A state dict is a tree of dicts (``str`` or ``int`` keys), lists and tuples whose leaves
are tensors or plain values.  Flattening names each leaf by its path, joined with dots as
torch's DCP does (``{"model": {"fc.weight": t}}`` -> ``"model.fc.weight"``), and keeps
the path itself so that a consolidated export can rebuild the tree.  Empty containers are
leaves too (an optimizer's ``state`` before the first step), so that nothing is lost.

Plain values are what JSON can hold, encoded losslessly: ``None``, ``bool``, ``int``,
``float`` (NaN and infinities tagged), ``str``, ``bytes`` (base64, tagged) and empty
containers (tagged).  Anything else is refused at save time: checkpoints never pickle.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "Leaf", "Path", "decode_value", "encode_value", "flatten", "join_path",
           "lists_back", "replace_leaves", "tree_from_paths"]

Path = tuple[str | int, ...]
MAX_DEPTH = 256     # parts of a path: deeper state dicts are refused on save and in metadata


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a state dict: its dotted key, its path and its value."""

    key: str
    path: Path
    value: Any

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)


def join_path(path: Path) -> str:
    return ".".join(str(p) for p in path)


def flatten(state_dict: dict[str, Any]) -> dict[str, Leaf]:
    """The leaves of ``state_dict`` by dotted key (in traversal order).

    Raises:
        TypeError: a key that is neither ``str`` nor ``int``, or a leaf that is neither a
            tensor nor a plain value (see :func:`encode_value`).
        ValueError: two paths that join to the same dotted key.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict: expected a dict, got {type(state_dict).__name__}")
    out: dict[str, Leaf] = {}
    for path, value in _walk(state_dict, ()):
        key = join_path(path)
        if key in out:
            raise ValueError(f"state_dict: the paths {list(out[key].path)} and {list(path)} both "
                             f"flatten to the key {key!r}; rename one of them")
        if not isinstance(value, torch.Tensor):
            encode_value(value, key)   # refuse unsupported values before any I/O
        out[key] = Leaf(key, path, value)
    return out


def _walk(node: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    if len(path) > MAX_DEPTH:
        raise ValueError(f"state_dict: {join_path(path[:8])!r}...: nested more than {MAX_DEPTH} "
                         "levels deep; a checkpoint holds paths of at most that many parts")
    if isinstance(node, dict) and node:
        for k, v in node.items():
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise TypeError(f"state_dict: key {k!r} under {join_path(path) or '<root>'!r}: "
                                f"expected a str or int key, got {type(k).__name__}")
            yield from _walk(v, (*path, k))
    elif isinstance(node, list | tuple) and node and not isinstance(node, torch.Size):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, i))
    else:
        yield path, node


_EMPTY = {"dict": dict, "list": list, "tuple": tuple}


def encode_value(value: Any, key: str = "?") -> Any:
    """``value`` as JSON (tagged objects for what JSON lacks).

    Raises:
        TypeError: ``value`` is not a plain value (tensors are stored elsewhere).
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, bytes | bytearray):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.Size):
        return {"$size": [int(s) for s in value]}
    for name, kind in _EMPTY.items():
        if type(value) is kind and not value:
            return {"$empty": name}
    raise TypeError(f"state_dict[{key!r}]: expected a tensor or a plain value (None, "
                    "bool, int, float, str, bytes, or dicts/lists/tuples of them), got "
                    f"{type(value).__name__}; checkpoints never pickle, so convert it "
                    "(or make its owner Stateful)")


def decode_value(data: Any, key: str = "?") -> Any:
    """The inverse of :func:`encode_value`; raises ``ValueError`` on anything it never writes."""
    if data is None or isinstance(data, bool | str | int | float):
        return data
    if isinstance(data, dict) and len(data) == 1:
        (tag, raw), = data.items()
        if tag == "$float" and raw in ("nan", "inf", "-inf"):
            return float(raw)
        if tag == "$bytes" and isinstance(raw, str):
            return base64.b64decode(raw.encode("ascii"), validate=True)
        if tag == "$size" and isinstance(raw, list) and all(isinstance(s, int) for s in raw):
            return torch.Size(raw)
        if tag == "$empty" and raw in _EMPTY:
            return _EMPTY[raw]()
    raise ValueError(f"checkpoint value {key!r}: expected a plain JSON value or a "
                     f"known tag, got {data!r:.200}")


def replace_leaves(root: dict[str, Any], updates: dict[Path, Any]) -> None:
    """Set the leaves at ``updates``' paths in ``root``, in place (tuples are rebuilt)."""
    by_head: dict[Any, dict[Path, Any]] = {}
    for path, value in updates.items():
        if not path:
            raise AssertionError("replace_leaves: the root itself is not a leaf")
        by_head.setdefault(path[0], {})[path[1:]] = value
    for head, rest in by_head.items():
        root[head] = _replace(root[head], rest)


def _replace(node: Any, updates: dict[Path, Any]) -> Any:
    if () in updates:
        return updates[()]
    if isinstance(node, dict | list):
        by_head: dict[Any, dict[Path, Any]] = {}
        for path, value in updates.items():
            by_head.setdefault(path[0], {})[path[1:]] = value
        for head, rest in by_head.items():
            node[head] = _replace(node[head], rest)
        return node
    if isinstance(node, tuple):
        items = list(node)
        _replace(items, updates)
        if hasattr(node, "_fields"):          # a namedtuple
            return type(node)(*items)
        return type(node)(items)
    raise AssertionError(f"replace_leaves: cannot descend into a {type(node).__name__}")


def tree_from_paths(leaves: list[tuple[Path, Any]]) -> dict[Any, Any]:
    """Nested dicts from ``(path, value)`` pairs; dicts keyed ``0 .. n-1`` become lists again."""
    tree: dict[Any, Any] = {}
    for path, value in leaves:
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return lists_back(tree)


def lists_back(node: Any) -> Any:
    """Dicts keyed ``0 .. n-1`` (flattened lists: param groups, their params) back to lists."""
    if not isinstance(node, dict):
        return node
    items = {k: lists_back(v) for k, v in node.items()}
    if (items and all(isinstance(k, int) for k in items)
            and sorted(items) == list(range(len(items)))):
        return [items[i] for i in range(len(items))]
    return items
