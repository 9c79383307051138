"""Helpers of the state-dict API: clean FQNs, full <-> sharded tensors, streaming broadcast.

* FQNs: wrappers add path components that the checkpoint must not see, so a model saved
  under DDP loads into a plain or fully_shard model: ``module.`` under a DDP wrapper,
  ``_orig_mod.`` (``torch.compile``) and ``_checkpoint_wrapped_module.`` are dropped.
* Full tensors: a DTensor gathers with ``full_tensor()``; a full tensor becomes a DTensor
  shaped like a model's DTensor by cutting this rank's box out of it (no communication).
* ``broadcast_leaves`` streams rank 0's tree to every rank one tensor at a time, so that
  the receivers can shard each tensor before the next one arrives (memory: one full tensor).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ringlet.c10d import collectives as C
from ringlet.c10d import world as _world
from ringlet.checkpoint._flatten import Path, decode_value, encode_value, flatten
from ringlet.checkpoint._local import load_piece
from ringlet.checkpoint._metadata import DTYPES, dtype_name
from ringlet.dtensor import DTensor
from ringlet.dtensor._api import wrap_local
from ringlet.parallel.ddp import DistributedDataParallel

__all__ = ["broadcast_leaves", "clean_fqn", "global_rank", "param_fqns", "shard_like", "to_full"]

_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module")


def clean_fqn(model: nn.Module, key: str) -> str:
    """``key`` of ``model.state_dict()`` without the components wrappers add."""
    out: list[str] = []
    mod: nn.Module | None = model
    for part in key.split("."):
        child = mod._modules.get(part) if isinstance(mod, nn.Module) else None
        wrapper = ((part == "module" and isinstance(mod, DistributedDataParallel))
                   or part in _WRAPPER_PARTS)
        if not (wrapper and child is not None):
            out.append(part)
        mod = child
    return ".".join(out)


def param_fqns(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its first clean FQN (tied parameters keep the first name)."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), clean_fqn(model, name))
    return out


def global_rank() -> int:
    w = _world.current_world(required=False)
    return 0 if w is None else w.rank


def to_full(value: Any, cpu_offload: bool, keep: bool) -> Any:
    """A full (non-DTensor) copy of a tensor leaf; ``keep=False`` gathers but returns None."""
    if not isinstance(value, torch.Tensor):
        return value
    full = value.full_tensor() if isinstance(value, DTensor) else value.detach()
    if not keep:
        return None
    return full.cpu() if cpu_offload else full


def shard_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``like``: this rank's box of it as a DTensor, or ``full`` itself."""
    if (not isinstance(like, DTensor) or isinstance(full, DTensor)
            or tuple(full.shape) != tuple(like.shape)):
        return full
    _, box, _ = load_piece(like)
    local = full.detach()
    for d, (o, n) in enumerate(zip(box.offsets, box.sizes, strict=True)):
        local = local.narrow(d, o, n)
    device = like.to_local().device
    if device.type == "meta":      # a model built on meta: the shard stays where the data is
        device = full.device
    local = local.to(device=device, copy=True).contiguous()
    return wrap_local(local, like.device_mesh, like.placements, shape=like.shape,
                      stride=like.stride())


def broadcast_leaves(tree: dict[str, Any] | None) -> Iterator[tuple[Path, Any]]:
    """Every leaf of rank 0's ``tree`` (others pass anything), on every rank, one at a time."""
    rank0 = global_rank() == 0
    if _world.current_world(required=False) is None:
        yield from ((leaf.path, leaf.value) for leaf in flatten(tree or {}).values())
        return
    leaves = list(flatten(tree or {}).values()) if rank0 else []
    skeleton = [[list(lf.path), "t", dtype_name(lf.value.dtype, lf.key), list(lf.value.shape)]
                if lf.is_tensor else [list(lf.path), "v", encode_value(lf.value, lf.key)]
                for lf in leaves]
    for i, entry in enumerate(_broadcast_json(skeleton if rank0 else None)):
        path = tuple(entry[0])
        if entry[1] == "v":
            yield path, decode_value(entry[2])
            continue
        t = (leaves[i].value.detach().contiguous() if rank0
             else torch.empty(entry[3], dtype=DTYPES[entry[2]][0]))
        C.broadcast(t, src=0)
        yield path, t


def _broadcast_json(obj: Any) -> Any:
    data = json.dumps(obj).encode("utf-8") if obj is not None else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    C.broadcast(n, src=0)
    buf = torch.zeros(int(n), dtype=torch.uint8)
    if data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    C.broadcast(buf, src=0)
    return json.loads(buf.numpy().tobytes())
