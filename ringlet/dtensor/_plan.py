"""What sharding rules answer (``Plan``), the rule registry, and what the dispatch cache records.

See [Note: DTensor dispatch] and [Note: dispatch cache] in ``_dispatch.py``.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Replicate

if TYPE_CHECKING:
    from ringlet.dtensor._opcall import OpCall

__all__ = ["FLOAT_BLIND", "NO_CACHE", "OVERRIDES", "RULES", "Decision", "Plan", "register",
           "replicate_rule", "unsupported"]

aten = torch.ops.aten
Rule = Callable[["OpCall"], "Plan"]
LocalFn = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
RULES: dict[Any, Rule] = {}
# Handlers that take over an op's whole dispatch while set (per thread, e.g. loss_parallel()).
OVERRIDES: contextvars.ContextVar[dict[Any, Callable[..., Any]] | None] = contextvars.ContextVar(
    "ringlet_dtensor_overrides", default=None)
# Ops never cached: those an override may take over (the cached path does not look at OVERRIDES):
# the cross-entropy pieces that ``loss_parallel()``
# (ringlet.parallel.tensor_parallel.loss) replaces.
NO_CACHE: set[Any] = {
    aten._log_softmax.default, aten._log_softmax_backward_data.default,
    aten.nll_loss_forward.default, aten.nll_loss_backward.default, aten.nll_loss2d_forward.default,
    aten.nll_loss2d_backward.default,
}


# Ops whose rule looks only at the presence of a Python float argument, never at its value: the
# dispatch cache keys their floats by type ([Note: dispatch cache]).  ``decide`` adds an op the
# first time it runs one whose rule says so (``rule.float_blind``).
FLOAT_BLIND: set[Any] = set()


def register(*ops: Any) -> Callable[[Rule], Rule]:
    """Register a sharding rule for aten overloads or whole overload packets."""
    def deco(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
        return rule
    return deco


@dataclasses.dataclass
class Plan:
    """A rule's answer (see [Note: DTensor dispatch]).

    ``inputs[k]``: placements DTensor argument ``k`` (``OpCall.dts`` order) must have.
    ``outputs``: placements of every tensor output (one tuple for all, or a list with
    one entry per tensor in the output's flattened order); ``None``: the local result
    is returned as is (a Python value).  ``local_fn(func, args, kwargs)`` replaces the
    op on the local tensors; it is kept in the dispatch cache, so it must depend only on
    what the cache key holds and must not close over tensors.
    """

    inputs: list[Placements]
    outputs: Placements | list[Placements] | None
    local_fn: LocalFn | None = None
    # Global output shapes when the rule knows them (one for all outputs, or one per output
    # leaf); ``"local"``: every output is Replicate, so the local shape is the global one;
    # None: run the op on meta tensors.  Elementwise ops, cat, addmm, layer norm... must say:
    # their meta kernels are Python references whose first use imports torch._dynamo (seconds).
    shapes: tuple[int, ...] | list[tuple[int, ...] | None] | str | None = None


ONE, MANY, WRITTEN, RAW, LOCAL = range(5)


class Decision(NamedTuple):
    """A recorded sharding decision ([Note: dispatch cache]); a tuple, so the hot path unpacks
    it as ``fn, moves, kind, out = decision``.

    ``fn(*local_args, **local_kwargs)`` runs the op; ``moves`` are
    ``(slot, j, src, dst, global_shape)``: redistribute argument ``slot`` (an index, or a
    keyword), element ``j`` of it when it is a list (else ``j == -1``); ``kind`` says
    what ``out`` is: ``ONE`` the output spec, ``MANY`` (container type, spec or None per
    leaf), ``WRITTEN`` the arguments returned (indices or keywords), ``RAW`` nothing
    (the local value is the answer), ``LOCAL`` (mesh, placements, specs by local shape
    and stride).
    """

    fn: Callable[..., Any]
    moves: tuple[Any, ...]
    kind: int
    out: Any


def unsupported(call: OpCall, why: str = "") -> NotImplementedError:
    extra = f" ({why})" if why else ""
    return NotImplementedError(
        f"{call.func}: no DTensor sharding rule for {call.describe()} on {call.mesh!r}{extra}; ops "
        "without a rule run only when every DTensor argument is Replicate: redistribute first "
        "(e.g. .redistribute(mesh, [Replicate()]) or .full_tensor())")


def replicate_rule(call: OpCall) -> Plan:
    """Any op whose DTensor arguments are all Replicate: run it locally, outputs Replicate."""
    rep = (Replicate(),) * call.mesh.ndim
    return Plan([rep] * len(call.dts), rep, shapes="local")
