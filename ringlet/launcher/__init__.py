"""ringlet's launcher: ``ringlet-run`` (``python -m ringlet.distributed.run``).

The command line and ``main`` live in :mod:`ringlet.launcher.run` (not re-exported here, so
that ``python -m ringlet.launcher.run`` runs without a double import); the pure planning
code, which tests and tools use, is re-exported.
"""

from ringlet.launcher._plan import LaunchConfig, parse_args, worker_command, worker_env

__all__ = ["LaunchConfig", "parse_args", "worker_command", "worker_env"]
