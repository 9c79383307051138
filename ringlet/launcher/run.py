"""``ringlet-run``: start N local worker processes with torchrun's interface.

Usage::

    ringlet-run --nproc-per-node 2 train.py --lr 0.1
    ringlet-run --nproc_per_node=cpu --max-restarts 3 -m mypkg.train
    python -m ringlet.distributed.run --standalone --nproc-per-node 4 train.py
    ringlet-run --nproc-per-node 2 --no-python ./worker.sh

The launcher hosts the rendezvous ``TCPStore`` itself (bound to ``--master-addr``,
127.0.0.1 by default, on ``--master-port`` or a port the store picks), protected by a
per-run random token kept in a 0600 file of a private run directory. Every worker gets
torchrun's environment::

    RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE
    ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT
    TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS
    TORCHELASTIC_ERROR_FILE

and ringlet's own::

    RINGLET_AGENT_STORE=1          the store is the launcher's: every rank is a client
    RINGLET_STORE_TOKEN_FILE=...   the file holding the store token
    RINGLET_RUN_DIR=...            private (0700) directory of this run, removed at exit
    RINGLET_GENERATION=<n>         restart generation (= TORCHELASTIC_RESTART_COUNT)
    RINGLET_LAUNCHER_PID=<pid>     lets a worker notice that the launcher is gone

plus ``OMP_NUM_THREADS=1`` when unset and more than one worker shares the node, and
``PYTHONUNBUFFERED=1``.

[Note: store generations] Every generation of workers talks to the *same* store, which
keeps the keys of earlier generations. ``init_process_group`` therefore prefixes all its
keys with the generation (``RINGLET_GENERATION``), so a restarted job never reads a
key that a dead generation wrote.

Each worker's output lines are forwarded with a ``[rank{r}]: `` prefix. When a worker
fails (non-zero exit or a signal), the others get SIGTERM, then SIGKILL after
``--grace-period`` seconds; with restarts left a new generation starts, otherwise the
launcher prints a summary of the first failure (rank, pid, exit code or signal, time,
traceback) and exits 1. SIGINT/SIGTERM to the launcher stop the workers the same way and
the launcher exits 128 + signal number.

``--restart-policy replica`` (with ``--replica-size``) restarts only the replica whose worker
failed while the others go on (``_replicas``; the workers use ``ringlet.ft`` to heal it).

Several nodes (``--nnodes N --node-rank R --master-addr A --master-port P``, or ``--from-env``
under srun/mpirun): see ``_multinode`` ([Note: node rendezvous] in ``_nodes``) and
[Note: run tokens] in ``_runtime``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ringlet.launcher._job import prepare, run_single
from ringlet.launcher._multinode import run_nodes
from ringlet.launcher._plan import LaunchConfig, build_parser, parse_args
from ringlet.launcher._replicas import supervise_replicas
from ringlet.launcher._runtime import say

__all__ = ["main", "run"]


def run(config: LaunchConfig) -> int:
    """Launch ``config`` on this node and supervise it; returns the launcher's exit code."""
    refused = prepare(config)
    if refused is not None:
        return refused
    if config.nnodes > 1:
        return run_nodes(config)
    return run_single(config, supervise_replicas if config.restart_policy == "replica" else None)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``ringlet-run``; exits with the launcher's exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        config = parse_args(args)
    except ValueError as err:
        build_parser().print_usage(sys.stderr)
        say(f"error: {err}")
        sys.exit(2)
    sys.exit(run(config))


if __name__ == "__main__":
    main()
