"""The one error type of the checkpoint layer."""

from __future__ import annotations

__all__ = ["CheckpointException"]


class CheckpointException(RuntimeError):
    """A save or load failed; raised on every rank with every failing rank's reason.

    ``failures`` maps a rank to its message (torch's ``CheckpointException`` carries the
    same information).  A checkpoint that failed to save is never committed, and a load
    that fails its checks leaves the state dict untouched.
    """

    def __init__(self, op: str, failures: dict[int, str]) -> None:
        self.op = op
        self.failures = dict(sorted(failures.items()))
        lines = [f"  rank {r}: {m}" for r, m in self.failures.items()]
        super().__init__(f"{op} failed on rank(s) {sorted(self.failures)}:\n" + "\n".join(lines))
