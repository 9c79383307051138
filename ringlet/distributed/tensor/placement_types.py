"""``ringlet.distributed.tensor.placement_types``: torch's placement classes (re-exports only)."""

from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = ["Partial", "Placement", "Replicate", "Shard", "_StridedShard"]
