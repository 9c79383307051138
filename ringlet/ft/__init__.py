"""Replica-level fault tolerance: training that goes on when a replica dies, and heals it back.

``Manager`` wraps each training step (quorum, gradient average over the live replicas, commit);
``init_replica_group`` makes a replica's own processes the default world for ``fully_shard`` or
TP inside the replica.  Launch with ``ringlet-run --restart-policy replica`` so that only the
failed replica is restarted.  Guide: docs/fault_tolerance.md.
"""

from ringlet.ft._quorum import JobFinished, QuorumError
from ringlet.ft.manager import Manager, StepReport, init_replica_group

__all__ = ["JobFinished", "Manager", "QuorumError", "StepReport", "init_replica_group"]
