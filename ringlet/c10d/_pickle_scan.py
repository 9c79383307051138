"""What a restricted payload's pickle would allocate, found by reading its opcodes, never running
them (part of [Note: restricted decode]).

The restricted unpickler lets a few Python callables through -- ``set``, ``frozenset``,
``bytearray``, ``bytes``, ``Counter``, ``OrderedDict``, ``torch.Size``, ``complex`` and
``_codecs.encode`` -- because ``torch.save`` uses them for plain data, always on arguments that the
pickle spells out (a list, a dict, a tuple of ints, a string).  Two other uses turn a few bytes
into gigabytes: ``bytearray(10**10)`` (a zero-filled buffer of that size) and any of them over a
tensor or storage (``set(t)`` makes one Python object per element).  :func:`amplifier` follows the
pickle's stack symbolically -- each value is only a tag: an int, a string, a tuple of tags, a
global, "plain data", or "made by a call" (possibly a tensor) -- and names the first such call.
"""

from __future__ import annotations

import _compat_pickle
import pickletools
from typing import Any

__all__ = ["amplifier"]

_WATCHED = {"builtins.set", "builtins.frozenset", "builtins.bytearray", "builtins.bytes",
            "collections.Counter", "collections.OrderedDict", "torch.Size", "builtins.complex",
            "_codecs.encode"}
_INTS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}
_STRS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
         "SHORT_BINSTRING"}
_KEEP_FIRST = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}
_CALLS = {"REDUCE": 0, "NEWOBJ": 0, "NEWOBJ_EX": 0}
_MARK = ("mark",)
_PLAIN = ("plain",)
_MADE = ("made",)     # the result of a call or a persistent load: possibly a tensor or storage
_INT = ("int",)


class _Unreadable(Exception):
    """The opcodes do not form a stack this scan can follow."""


def _global_name(module: str, name: str) -> str:
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _call_problem(func: tuple[Any, ...], args: tuple[Any, ...]) -> str | None:
    if func[0] != "global" or func[1] not in _WATCHED:
        return None
    if args[0] != "tuple":
        return f"{func[1]} is called with arguments the pickle does not spell out"
    if any(a is _MADE for a in args[1]):
        return (f"{func[1]} is called on a tensor or storage (it would build one Python object "
                "per element)")
    if func[1] in ("builtins.bytearray", "builtins.bytes") and any(a is _INT for a in args[1]):
        return (f"{func[1]} is called with a count (it would allocate memory the payload did not "
                "carry)")
    return None


def _pop(stack: list[Any], op: pickletools.OpcodeInfo) -> list[Any]:
    """The items ``op`` consumes (with a mark: those below it, then the slice above it)."""
    before = op.stack_before
    if pickletools.markobject in before:
        at = len(stack) - 1 - stack[::-1].index(_MARK) if _MARK in stack else -1
        if at < 0:
            raise _Unreadable(f"{op.name} without a mark")
        sliced = stack[at + 1:]
        del stack[at:]
        below = before.index(pickletools.markobject)
        if len(stack) < below:
            raise _Unreadable(f"{op.name} on a short stack")
        items = stack[len(stack) - below:] if below else []
        del stack[len(stack) - below:]
        return [*items, ("tuple", sliced)]
    n = len(before)
    if len(stack) < n:
        raise _Unreadable(f"{op.name} on a short stack")
    items = stack[len(stack) - n:] if n else []
    del stack[len(stack) - n:]
    return items


def _step(stack: list[Any], memo: dict[Any, Any], op: pickletools.OpcodeInfo,
          arg: Any) -> str | None:
    name = op.name
    if name == "MARK":
        stack.append(_MARK)
        return None
    if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
        if not stack:
            raise _Unreadable(f"{name} on an empty stack")
        memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        return None
    if name in ("GET", "BINGET", "LONG_BINGET"):
        stack.append(memo.get(arg, _MADE))
        return None
    got = _pop(stack, op)
    if name in _CALLS:
        func, args = got[0], got[1]
        problem = _call_problem(func, args)
        if problem is not None:
            return problem
        watched = func[0] == "global" and func[1] in _WATCHED
        stack.append(_PLAIN if watched else _MADE)
    elif name == "GLOBAL":
        module, _, attr = str(arg).partition(" ")
        stack.append(("global", _global_name(module, attr)))
    elif name == "STACK_GLOBAL":
        ok = all(g[0] == "str" for g in got)
        stack.append(("global", _global_name(got[0][1], got[1][1])) if ok else _MADE)
    elif name in _INTS:
        stack.append(_INT)
    elif name in _STRS:
        stack.append(("str", str(arg)))
    elif name in ("EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
        stack.append(got[-1] if name == "TUPLE" else ("tuple", list(got)))
    elif name in _KEEP_FIRST:
        stack.append(got[0])
    elif name == "DUP":
        stack.extend([got[0], got[0]])
    elif op.stack_after:
        stack.extend(_MADE if name in ("BINPERSID", "PERSID", "OBJ", "INST") else _PLAIN
                     for _ in op.stack_after)
    return None


def amplifier(pickle_bytes: bytes) -> str | None:
    """The first call in ``pickle_bytes`` that would allocate far more than the payload holds, or
    ``None``.  Where the opcodes stop making sense (a bad opcode, a pop from an empty stack) the
    scan ends: the unpickler fails at the same point, having run only what was scanned."""
    stack: list[Any] = []
    memo: dict[Any, Any] = {}
    try:
        for op, arg, _pos in pickletools.genops(pickle_bytes):
            problem = _step(stack, memo, op, arg)
            if problem is not None:
                return problem
    except (_Unreadable, ValueError, IndexError):
        return None
    return None
