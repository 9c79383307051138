"""What a healing replica receives, and the layout check that comes first.

A replica's state is its local tensors (parameters and buffers; for a sharded model the local
shards), the optimizer's state, the step count, the random generators and whatever the user
added (``stateful=``: a learning-rate scheduler, a data position).  DTensors travel as their
local tensors: the healer has the same layout (the fingerprint guarantees it), so each shard
goes to the position that holds it.  The payload is ``torch.save`` bytes read back with
``weights_only=True``: nothing a peer sends can run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["describe_difference", "fingerprint", "json_bytes", "json_load", "layout", "load_state",
           "pack", "state_of", "unpack"]


def _local(t: Any) -> Any:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and isinstance(t, torch.Tensor) else t


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named: dict[str, torch.Tensor] = dict(model.named_parameters())
    named.update(model.named_buffers())
    return named


def layout(model: nn.Module, optimizer: Any, replica_size: int) -> dict[str, Any]:
    """What two replicas must share to heal one from the other: each local tensor's name, shape
    and dtype, the optimizer's class and the processes per replica."""
    tensors = {name: [list(_local(t).shape), str(t.dtype)] for name, t in _tensors(model).items()}
    return {"replica_size": replica_size, "optimizer": type(optimizer).__name__,
            "tensors": tensors}


def fingerprint(desc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def describe_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """The first difference between two layouts, in words."""
    for key in ("replica_size", "optimizer"):
        if mine[key] != theirs[key]:
            return f"{key} is {mine[key]!r} here, {theirs[key]!r} on the live replicas"
    a, b = mine["tensors"], theirs["tensors"]
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"this model has {name!r}, the live replicas' does not"
        if name not in a:
            return f"the live replicas' model has {name!r}, this one does not"
        if a[name] != b[name]:
            return (f"{name!r} is {a[name][1]} of local shape {tuple(a[name][0])} here, "
                    f"{b[name][1]} of {tuple(b[name][0])} on the live replicas")
    return "the layouts hash differently"


def _plain(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local tensor."""
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


def state_of(model: nn.Module, optimizer: Any, step: int,
             stateful: Sequence[Any]) -> dict[str, Any]:
    """Everything a healing replica needs, as plain tensors and Python values."""
    return {
        "step": step,
        "model": {k: _local(t).detach() for k, t in _tensors(model).items()},
        "optimizer": _plain(optimizer.state_dict()) if optimizer is not None else None,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "stateful": [_plain(s.state_dict()) for s in stateful],
    }


def load_state(model: nn.Module, optimizer: Any, stateful: Sequence[Any],
               state: dict[str, Any]) -> int:
    """Make this replica the sender's copy; returns the step count."""
    with torch.no_grad():
        for name, t in _tensors(model).items():
            _local(t).copy_(state["model"][name])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        _rewrap_optimizer_state(optimizer)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(_tuples(state["rng"]["python"]))
    for obj, sd in zip(stateful, state["stateful"], strict=True):
        obj.load_state_dict(sd)
    return int(state["step"])


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


def _rewrap_optimizer_state(optimizer: Any) -> None:
    """State of a DTensor parameter arrives as its local tensor: wrap it in the parameter's
    placements again (the optimizer's step then meets DTensors, as it did on the sender)."""
    from ringlet.dtensor import DTensor

    for p, st in optimizer.state.items():
        if not isinstance(p, DTensor):
            continue
        local_shape = p.to_local().shape
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) \
                    and v.shape == local_shape and v.dim() > 0:
                st[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())


def pack(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as a byte tensor."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(data: torch.Tensor) -> dict[str, Any]:
    """The state in ``data``; loads tensors and plain values only (``weights_only``)."""
    loaded = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    if not isinstance(loaded, dict):
        raise TypeError(f"expected a replica's state (a dict), got {type(loaded).__name__}")
    return loaded


def json_bytes(desc: dict[str, Any]) -> bytes:
    return json.dumps(desc, sort_keys=True).encode()


def json_load(raw: bytes) -> dict[str, Any]:
    loaded = json.loads(raw)
    if not isinstance(loaded, dict):
        raise TypeError(f"expected a layout record (a JSON object), got {type(loaded).__name__}")
    return loaded
