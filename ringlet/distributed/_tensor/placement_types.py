"""``ringlet.distributed._tensor.placement_types``: legacy path of the placements (re-exports
only)."""

from ringlet.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]
