"""The ``torch.autograd.Function`` of each collective in ``nn_functional``.

Each forward runs one collective on the arguments ``nn_functional`` has already checked; each
backward runs the adjoint by calling another Function of this module, so that a backward under
``create_graph=True`` is itself differentiable ([Note: collectives in autograd] in
``nn_functional``).  Forwards run with grad mode off (autograd's rule), so the collectives write
their results without autograd seeing it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ringlet.c10d import checks
from ringlet.c10d import collectives as c
from ringlet.c10d.group import ProcessGroup
from ringlet.transport.reduce import RedOpType

__all__ = ["AllGather", "AllGatherBase", "AllReduce", "AllToAll", "AllToAllSingle", "Broadcast",
           "Gather", "Reduce", "ReduceScatter", "Reduction", "Scatter"]

Ctx = Any       # torch's FunctionCtx: attributes are set on it freely


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A checked ``op=`` argument: what the user passed, and what it means."""

    op: Any                     # as given (a RedOpType, a ReduceOp with a factor, ...)
    red: RedOpType
    factor: float | None        # PREMUL_SUM's factor
    name: str                   # the public function, for errors

    def scale(self, world_size: int) -> float:
        """``c`` such that the reduction is ``c * sum``; the gradient is scaled by it.

        Raises:
            ValueError: the op is not linear, so it has no gradient of this form.
        """
        if self.red == RedOpType.SUM:
            return 1.0
        if self.red == RedOpType.AVG:
            return 1.0 / world_size
        if self.red == RedOpType.PREMUL_SUM and self.factor is not None:
            return self.factor
        raise checks.fail(ValueError, self.name, "op", "expected ReduceOp.SUM, AVG or PREMUL_SUM "
                          f"to differentiate, got ReduceOp.{self.red.name}: its gradient is not a "
                          "reduction of the ranks' gradients (detach() the input, or use "
                          "ringlet.distributed's collective under torch.no_grad())")


def _scaled(g: torch.Tensor, c: float) -> torch.Tensor:
    return g if c == 1.0 else g * c


def _empty(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor shaped like ``t`` (torch's results are contiguous whatever the
    input's strides)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, r: Reduction, tensor: torch.Tensor) -> torch.Tensor:
        ctx.pg, ctx.r = pg, r
        out = tensor.clone()
        c.all_reduce(out, r.op, group=pg)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.r.scale(ctx.pg.size())      # refuses an op that is not linear
        return None, None, AllReduce.apply(ctx.pg, ctx.r, grad)


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, root: int, tensor: torch.Tensor) -> torch.Tensor:
        ctx.pg, ctx.root = pg, root
        out = tensor.clone() if pg.rank() == root else _empty(tensor)
        c.broadcast(out, group=pg, group_src=root)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        total = Reduce.apply(ctx.pg, ctx.root, _SUM, grad)
        if ctx.pg.rank() != ctx.root:    # only the source's input reached the outputs
            total = torch.zeros_like(total)
        return None, None, total


class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, root: int, r: Reduction,
                tensor: torch.Tensor) -> torch.Tensor:
        ctx.pg, ctx.root, ctx.r = pg, root, r
        out = tensor.clone()
        c.reduce(out, op=r.op, group=pg, group_dst=root)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        scale = ctx.r.scale(ctx.pg.size())
        return None, None, None, _scaled(Broadcast.apply(ctx.pg, ctx.root, grad), scale)


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.pg = pg
        outs = [_empty(tensor) for _ in range(pg.size())]
        c.all_gather(outs, tensor, group=pg)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        return None, ReduceScatter.apply(ctx.pg, _SUM, _empty(grads[0]), *grads)


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, r: Reduction, output: torch.Tensor,
                *inputs: torch.Tensor) -> torch.Tensor:
        ctx.pg, ctx.r = pg, r
        c.reduce_scatter(output, list(inputs), r.op, group=pg)
        return output       # autograd returns a view of it, as torch's does

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        scale = ctx.r.scale(ctx.pg.size())
        grads = AllGather.apply(ctx.pg, grad)
        return (None, None, None, *(_scaled(g, scale) for g in grads))


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, root: int,
                tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.pg, ctx.root = pg, root
        n = pg.size()
        if pg.rank() != root:
            c.gather(tensor, None, group=pg, group_dst=root)
            return tuple(torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                         for _ in range(n))
        outs = [_empty(tensor) for _ in range(n)]
        c.gather(tensor, outs, group=pg, group_dst=root)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        return None, None, Scatter.apply(ctx.pg, ctx.root, *grads)


class Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, root: int, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.pg, ctx.root = pg, root
        me = pg.rank()
        out = _empty(tensors[me])
        c.scatter(out, list(tensors) if me == root else None, group=pg, group_src=root)
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        # Gather returns zeros off the root: only the root's pieces reached the outputs.
        return (None, None, *Gather.apply(ctx.pg, ctx.root, grad))


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, outputs: list[torch.Tensor],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # ``outputs`` travel as a plain list, so autograd does not see them as inputs: the
        # very tensors come back, now outputs of this node (torch's behaviour).
        ctx.pg, ctx.like = pg, [(t.shape, t.dtype, t.device) for t in inputs]
        c.all_to_all(outputs, list(inputs), group=pg)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        back = [torch.empty(s, dtype=d, device=dev) for s, d, dev in ctx.like]
        return (None, None, *AllToAll.apply(ctx.pg, back, *grads))


class AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, splits: tuple[Any, Any], output: torch.Tensor,
                input: torch.Tensor) -> torch.Tensor:
        ctx.pg, ctx.splits = pg, splits
        ctx.shape, ctx.dtype, ctx.device = input.shape, input.dtype, input.device
        c.all_to_all_single(output, input, splits[0], splits[1], group=pg)
        return output       # autograd returns a view of it, as torch's does

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        back = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        out_splits, in_splits = ctx.splits
        g = AllToAllSingle.apply(ctx.pg, (in_splits, out_splits), back, grad)
        return None, None, None, g


class AllGatherBase(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Ctx, pg: ProcessGroup, output: torch.Tensor,
                input: torch.Tensor) -> torch.Tensor:
        ctx.pg, ctx.shape = pg, input.shape
        c.all_gather_into_tensor(output, input, group=pg)
        return output

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        # The output holds the ranks' blocks in order, stacked or concatenated: either way
        # block r is the r-th run of numel(input) elements.
        blocks = grad.reshape(ctx.pg.size(), *ctx.shape).unbind(0)
        out = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return None, None, ReduceScatter.apply(ctx.pg, _SUM, out, *blocks)


_SUM = Reduction(RedOpType.SUM, RedOpType.SUM, None, "backward")
