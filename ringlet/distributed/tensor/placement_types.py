"""``ringlet.distributed.tensor.placement_types``: torch's placement classes (re-exports only)."""

from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]
