"""ringlet's version and the torch versions it supports, checked once at import.

``__version__`` comes from the installed package's metadata (``pyproject.toml`` is the one
place the number is written); a source tree that was never installed reports ``0+unknown``.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["TORCH_MAX_EXCLUSIVE", "TORCH_MIN", "__version__", "check_torch"]

# The range pyproject.toml declares.  The test suite runs on torch 2.13.
TORCH_MIN = (2, 13)
TORCH_MAX_EXCLUSIVE = (3, 0)

try:
    __version__ = metadata.version("ringlet")
except metadata.PackageNotFoundError:          # imported from a source tree, never installed
    __version__ = "0+unknown"


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def check_torch(version: str) -> None:
    """Raise ``ImportError`` naming both versions when ``version`` of torch is outside the range.

    Example::

        check_torch("2.13.0")      # fine
        check_torch("2.3.1")       # ImportError: ringlet ... needs torch >= 2.13, < 3.0 ...
    """
    got = _release(version)
    if not TORCH_MIN <= got < TORCH_MAX_EXCLUSIVE:
        lo = ".".join(map(str, TORCH_MIN))
        hi = ".".join(map(str, TORCH_MAX_EXCLUSIVE))
        raise ImportError(f"ringlet {__version__} needs torch >= {lo}, < {hi}; this environment "
                          f"has torch {version}. Install a supported torch (pip install "
                          f"'torch>={lo},<{hi}')")
