"""Rank bodies for tests/test_torch_api.py that need real processes (run_world pickles them)."""

from __future__ import annotations

from typing import Any

import ringlet.distributed as dist
from ringlet.distributed import distributed_c10d as c10d


def backend_names(rank: int, n: int) -> dict[str, Any]:
    return {"backend": dist.get_backend(), "name": dist.group.WORLD.name(),
            "transport": dist.group.WORLD.transport_name, "repr": repr(dist.group.WORLD),
            "config": c10d._get_pg_config()["backend_config"]}
