"""DTensor's collectives in a form torch.compile can trace (AOT autograd, inductor).

[Note: traceable collectives]
Eagerly, ``_comm`` calls ringlet's collectives in place on real tensors.  When torch.compile
traces a DTensor op (dynamo's fake propagation, AOT autograd's functionalization), the local
tensors are stand-ins (``FakeTensor``, ``FunctionalTensor``) that hold no data, and an in-place
collective cannot be recorded.  Then ``_comm`` calls these custom ops instead: functional (a new
tensor out, the input untouched), with a fake kernel that only gives the output's shape, so the
tracer records one node per collective in the graph; when the compiled graph runs, the node calls
the real kernel, which runs ringlet's collective on real tensors.  The group travels as its
``group_name`` (a graph holds no Python objects as arguments), resolved among the groups of the
calling thread's world when the graph runs: names are given in creation order, the same on every
rank and in every run of the same script, so a graph that torch's compile cache brings back from
an earlier process finds the same group.  A compiled graph may hold rank-specific constants (a
coordinate, split sizes), so DTensor's cache key names the rank
(``DTensor._stable_hash_for_caching``): ranks never share a cached graph.

What is traced: the even, rank-ordered all-gather, reduce-scatter and all-reduce, the
all-to-all and the broadcast of ``_comm``; an uneven all-gather over a mesh line whose ranks are
not in order is refused under tracing with an error that says so.  Every rank must compile the
same graph (the same model, the same inputs' shapes), as every rank must issue the same
collectives eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ringlet.c10d import collectives as C
from ringlet.c10d import world as _world
from ringlet.c10d.group import ProcessGroup
from ringlet.c10d.reduce_op import ReduceOp

__all__ = ["all_gather", "all_reduce", "all_to_all_single", "broadcast", "reduce_scatter",
           "tracing"]

_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
        "product": ReduceOp.PRODUCT}


def tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tracer's stand-in rather than a tensor holding data."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


def _key(pg: ProcessGroup) -> str:
    return pg.group_name


def _group(name: str) -> ProcessGroup:
    w = _world.current_world(required=False)
    for pg in (w.groups if w is not None else ()):
        if pg.group_name == name:
            return pg
    raise RuntimeError(f"a compiled graph ran a DTensor collective on process group {name!r}, "
                       "which this process does not have (destroyed after compiling, or a graph "
                       "compiled for a job with other groups); compile the model again")


def _op_name(op: Any) -> str:
    for name, value in _OPS.items():
        if op == value:
            return name
    raise NotImplementedError(f"torch.compile: DTensor collective with reduce op {op!r} is not "
                              f"traceable (expected one of {sorted(_OPS)})")


def _checked(name: str, t: torch.Tensor, op: str | None = None,
             world: int | None = None) -> None:
    """The custom ops' arguments, checked where a user calling ``torch.ops.ringlet.*`` sees it."""
    if op is not None and op not in _OPS:
        raise ValueError(f"torch.ops.ringlet.{name}: expected op one of {sorted(_OPS)}, "
                         f"got {op!r}")
    if world is None:
        return
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"torch.ops.ringlet.{name}: expected world (the group's size) >= 1, "
                         f"got {world!r}")
    if t.dim() == 0:
        raise ValueError(f"torch.ops.ringlet.{name}: expected a tensor with at least one "
                         "dimension (ranks are stacked along dim 0), got a 0-d tensor")
    if name == "reduce_scatter" and t.shape[0] % world:
        raise ValueError(f"torch.ops.ringlet.reduce_scatter: expected dim 0 divisible by world "
                         f"{world}, got shape {list(t.shape)}")


def _sized(name: str, world: int, group: str) -> ProcessGroup:
    pg = _group(group)
    if world != pg.size():
        raise ValueError(f"torch.ops.ringlet.{name}: expected world {pg.size()} (the size of "
                         f"group {group!r}), got {world}")
    return pg


# -- the custom ops -------------------------------------------------------------------------------
@torch.library.custom_op("ringlet::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, op: str, group: str) -> torch.Tensor:
    _checked("all_reduce", t, op)
    out = t.clone(memory_format=torch.contiguous_format)
    C.all_reduce(out, op=_OPS[op], group=_group(group))
    return out


@_all_reduce.register_fake
def _(t: torch.Tensor, op: str, group: str) -> torch.Tensor:
    _checked("all_reduce", t, op)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@torch.library.custom_op("ringlet::all_gather", mutates_args=())
def _all_gather(t: torch.Tensor, world: int, group: str) -> torch.Tensor:
    _checked("all_gather", t, world=world)
    pg = _sized("all_gather", world, group)
    out = t.new_empty([world * t.shape[0], *t.shape[1:]])
    C.all_gather_into_tensor(out, t.contiguous(), group=pg)
    return out


@_all_gather.register_fake
def _(t: torch.Tensor, world: int, group: str) -> torch.Tensor:
    _checked("all_gather", t, world=world)
    return t.new_empty([world * t.shape[0], *t.shape[1:]])


@torch.library.custom_op("ringlet::reduce_scatter", mutates_args=())
def _reduce_scatter(t: torch.Tensor, op: str, world: int, group: str) -> torch.Tensor:
    _checked("reduce_scatter", t, op, world)
    pg = _sized("reduce_scatter", world, group)
    out = t.new_empty([t.shape[0] // world, *t.shape[1:]])
    C.reduce_scatter_tensor(out, t.contiguous(), op=_OPS[op], group=pg)
    return out


@_reduce_scatter.register_fake
def _(t: torch.Tensor, op: str, world: int, group: str) -> torch.Tensor:
    _checked("reduce_scatter", t, op, world)
    return t.new_empty([t.shape[0] // world, *t.shape[1:]])


@torch.library.custom_op("ringlet::all_to_all_single", mutates_args=())
def _all_to_all_single(t: torch.Tensor, out_splits: list[int], in_splits: list[int],
                       group: str) -> torch.Tensor:
    out = t.new_empty([sum(out_splits), *t.shape[1:]])
    C.all_to_all_single(out, t.contiguous(), output_split_sizes=out_splits,
                        input_split_sizes=in_splits, group=_group(group))
    return out


@_all_to_all_single.register_fake
def _(t: torch.Tensor, out_splits: list[int], in_splits: list[int],
      group: str) -> torch.Tensor:
    return t.new_empty([sum(out_splits), *t.shape[1:]])


@torch.library.custom_op("ringlet::broadcast", mutates_args=())
def _broadcast(t: torch.Tensor, src: int, group: str) -> torch.Tensor:
    out = t.clone(memory_format=torch.contiguous_format)
    C.broadcast(out, group=_group(group), group_src=src)
    return out


@_broadcast.register_fake
def _(t: torch.Tensor, src: int, group: str) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# -- what _comm calls ------------------------------------------------------------------------------
def all_reduce(buf: torch.Tensor, op: Any, pg: ProcessGroup) -> torch.Tensor:
    """``buf`` reduced over ``pg``: in place eagerly (``buf`` returned), a new tensor traced."""
    if tracing(buf):
        return torch.ops.ringlet.all_reduce(buf, _op_name(op), _key(pg))
    C.all_reduce(buf, op=op, group=pg)
    return buf


def all_gather(out: torch.Tensor, t: torch.Tensor, pg: ProcessGroup) -> torch.Tensor:
    """Every rank's ``t`` stacked along dim 0 (into ``out`` eagerly)."""
    if tracing(t):
        return torch.ops.ringlet.all_gather(t, pg.size(), _key(pg))
    C.all_gather_into_tensor(out, t, group=pg)
    return out


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, op: Any,
                   pg: ProcessGroup) -> torch.Tensor:
    """This rank's chunk of dim 0 of ``t`` reduced over ``pg`` (into ``out`` eagerly)."""
    if tracing(t):
        return torch.ops.ringlet.reduce_scatter(t, _op_name(op), pg.size(), _key(pg))
    C.reduce_scatter_tensor(out, t, op=op, group=pg)
    return out


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, out_splits: list[int],
                      in_splits: list[int], pg: ProcessGroup) -> torch.Tensor:
    """``all_to_all_single`` on dim 0 (into ``out`` eagerly)."""
    if tracing(t):
        return torch.ops.ringlet.all_to_all_single(t, out_splits, in_splits, _key(pg))
    C.all_to_all_single(out, t, output_split_sizes=out_splits, input_split_sizes=in_splits,
                        group=pg)
    return out


def broadcast(buf: torch.Tensor, src: int, pg: ProcessGroup) -> torch.Tensor:
    """Group rank ``src``'s ``buf`` (in place eagerly)."""
    if tracing(buf):
        return torch.ops.ringlet.broadcast(buf, src, _key(pg))
    C.broadcast(buf, group=pg, group_src=src)
    return buf
