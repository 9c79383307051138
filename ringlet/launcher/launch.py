"""``python -m ringlet.distributed.launch``: ``torch.distributed.launch``'s
interface on ringlet-run.

Usage::

    python -m ringlet.distributed.launch --nproc-per-node 2 train.py --lr 0.1          # old style
    python -m ringlet.distributed.launch --nproc-per-node 2 --use-env train.py --lr 0.1

Every ``ringlet-run`` flag is accepted, plus torch's ``--use-env``.  Without it each worker's
script gets ``--local-rank=N`` (its local rank) before its own arguments, as torch's launch did --
``--local-rank-spelling underscore`` passes ``--local_rank=N`` for scripts whose parser knows only
that older spelling; ``LOCAL_RANK`` is set either way.  ``--no-python`` needs ``--use-env`` (a
command cannot parse the flag).  Like torch's, this entry point is deprecated: prefer
``ringlet-run``, which sets ``LOCAL_RANK`` only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ringlet.launcher._plan import build_parser, parse_args
from ringlet.launcher._runtime import say
from ringlet.launcher.run import run

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point; exits with the launcher's exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        config = parse_args(args, legacy_launch=True)
    except ValueError as err:
        build_parser(legacy_launch=True).print_usage(sys.stderr)
        say(f"error: {err}")
        sys.exit(2)
    say("python -m ringlet.distributed.launch is deprecated, as torch.distributed.launch is: use "
        "ringlet-run, which sets LOCAL_RANK in the environment instead of passing --local-rank")
    sys.exit(run(config))


if __name__ == "__main__":
    main()
