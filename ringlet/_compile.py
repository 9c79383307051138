"""``compiler_disable``: ``torch.compiler.disable`` without importing ``torch._dynamo`` first.

[Note: lazy compiler disable]
``torch.compiler.disable(fn)`` imports ``torch._dynamo`` (about a second, with sympy and much of
torch's compiler stack), so applying it at import time made ``import ringlet.distributed`` cost
that second in every run, compiled or not.  :func:`compiler_disable` returns a wrapper instead
that dynamo treats exactly like a disabled function, and that imports nothing:

- When dynamo traces a call to the wrapper it sees what it looks for on a disabled function
  (``_torchdynamo_disable`` and the original callable, set as attributes): a graph break, the
  call run eagerly, guarded on the original function as for ``torch.compiler.disable``.
- When the wrapper's own frame runs under a compiled region (after that graph break), dynamo
  must not compile it: its code object (one for every wrapper) is marked skipped as soon as
  ``torch._dynamo`` is imported -- an import hook waits for that import if it has not happened
  yet -- and the wrapper calls ``torch.compiler.disable(fn)`` (made on first use), which runs
  ``fn`` and everything it calls with dynamo off.
- Before ``torch._dynamo`` is imported nothing can be compiling, so the wrapper calls ``fn``
  directly.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import CodeType, ModuleType
from typing import Any, TypeVar

import torch

__all__ = ["compiler_disable"]

F = TypeVar("F", bound=Callable[..., Any])
_DYNAMO = "torch._dynamo"
_lock = threading.Lock()
_hooked = False                  # the import hook is installed, or the code is marked skipped


def compiler_disable(fn: F) -> F:
    """``torch.compiler.disable(fn)`` as dynamo sees it, without importing ``torch._dynamo``
    ([Note: lazy compiler disable])."""
    if not callable(fn):
        raise TypeError(f"compiler_disable: expected a callable, got {type(fn).__name__}")
    disabled: Callable[..., Any] | None = None

    def run_eagerly(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            if _DYNAMO not in sys.modules:      # no dynamo: nothing is being compiled
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    functools.update_wrapper(run_eagerly, fn)   # (not @wraps: its stub type has no __code__)
    # what dynamo reads on a disabled function (torch.compiler.disable sets the same)
    run_eagerly._torchdynamo_disable = True                 # type: ignore[attr-defined]
    run_eagerly._torchdynamo_disable_msg = None             # type: ignore[attr-defined]
    run_eagerly._torchdynamo_orig_callable = fn             # type: ignore[attr-defined]
    run_eagerly._torchdynamo_wrapper_id = id(run_eagerly)   # type: ignore[attr-defined]
    run_eagerly._torchdynamo_disable_recursive = True       # type: ignore[attr-defined]
    _skip_when_dynamo_loads(run_eagerly.__code__)
    return run_eagerly  # type: ignore[return-value]


def _skip_when_dynamo_loads(code: CodeType) -> None:
    """Mark ``code`` skipped by dynamo now if it is loaded, else as soon as it is."""
    global _hooked
    with _lock:
        if _hooked:
            return
        _hooked = True
        dynamo = sys.modules.get(_DYNAMO)
        if dynamo is None:
            sys.meta_path.insert(0, _OnDynamoImport(code))
            return
    _skip_code(code)


def _skip_code(code: CodeType) -> None:
    from torch._dynamo.eval_frame import skip_code

    skip_code(code)


class _OnDynamoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch._dynamo`` is imported, wraps the module's loader so that
    ``code`` is marked skipped right after the module has run, then removes itself."""

    def __init__(self, code: CodeType) -> None:
        self.code = code

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _skip_code(self.code)

        spec.loader.exec_module = exec_module
        return spec
