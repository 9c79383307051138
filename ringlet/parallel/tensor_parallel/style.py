"""Parallel styles: how one module's parameters are sharded and how its inputs/outputs are laid out.

Megatron-style tensor parallelism on a 1-d mesh ("tp"):

* :class:`ColwiseParallel` -- ``nn.Linear`` weight/bias ``Shard(0)`` (output features
  split; ``nn.Embedding``: ``Shard(1)``, embedding dims split).  Input ``Replicate``,
  output sharded on its last dim.  Forward: no communication; backward: the input's
  gradient is a partial sum, reduced once where the replicated input came from.
* :class:`RowwiseParallel` -- ``nn.Linear`` weight ``Shard(1)`` (input features split),
  bias ``Replicate`` (``nn.Embedding``: ``Shard(0)``, vocabulary rows split).  Input
  sharded on its last dim (``Replicate`` indices for an embedding), output a partial
  sum: one all-reduce to ``Replicate`` (default) or one reduce-scatter to ``Shard(d)``.
* :class:`SequenceParallel` -- norms and dropout on activations sharded on the sequence
  dim; parameters ``Replicate``; no communication of its own.

Every style keeps torch's signature.  Inputs that arrive as plain tensors are taken as
this rank's piece in the declared layout (``DTensor.from_local``, no communication); a
row-wise ``nn.Linear`` knows its input's global width, so unevenly split inputs work.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import nn

from ringlet.dtensor import DTensor, Placement, Replicate, Shard, distribute_module
from ringlet.mesh import DeviceMesh
from ringlet.parallel.tensor_parallel._layouts import as_layout, distribute_param, to_output

__all__ = ["ColwiseParallel", "ParallelStyle", "RowwiseParallel", "SequenceParallel"]


class ParallelStyle(ABC):
    """Base class of the parallel styles: ``_apply(module, device_mesh)`` parallelizes one module.

    ``src_data_rank`` (set by ``parallelize_module``) is the mesh coordinate whose
    parameter values are distributed (``None``: every rank keeps its own).
    """

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


def _first_input(inputs: tuple[Any, ...], style: str) -> Any:
    if not inputs:
        raise ValueError(f"{style}: expected the module to be called with a "
                         "tensor input, got no arguments")
    return inputs[0]


def _module_kind(module: nn.Module, style: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise NotImplementedError(f"{style}: expected an nn.Linear or nn.Embedding module, got "
                              f"{type(module).__name__}")


def _plain_shape(x: Any, given: Placement, width: int | None) -> tuple[int, ...] | None:
    """Global shape of a plain input that is this rank's piece of its last dim (``width`` wide)."""
    if width is None or isinstance(x, DTensor) or not isinstance(given, Shard) or x.dim() == 0:
        return None
    return (*x.shape[:-1], width) if given.dim % x.dim() == x.dim() - 1 else None


class _ShardedLayer(ParallelStyle):
    """What column- and row-wise sharding share: an ``nn.Linear``/``nn.Embedding`` whose input is
    laid out ``desired_input_layouts`` and whose output becomes ``output_layouts``."""

    input_layouts: tuple[Placement, ...]
    output_layouts: tuple[Placement, ...]
    desired_input_layouts: tuple[Placement, ...]
    use_local_output: bool

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        raise NotImplementedError

    def _runtime_input(self, kind: str) -> Placement:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        self.desired_input_layouts = (self._runtime_input(_module_kind(module, style)),)
        given, desired = self.input_layouts[0], self.desired_input_layouts[0]
        out_layout, use_local = self.output_layouts[0], self.use_local_output
        # A row-wise linear knows its input's global width: uneven splits of it still fit.
        width = (module.in_features if isinstance(module, nn.Linear) and isinstance(desired, Shard)
                 else None)

        def prepare_input(mod: nn.Module, inputs: tuple[Any, ...],
                          mesh: DeviceMesh) -> tuple[Any, ...]:
            x = _first_input(inputs, style)
            return (as_layout(x, mesh, given, desired, _plain_shape(x, given, width)), *inputs[1:])

        def prepare_output(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            return to_output(out, mesh, out_layout, use_local)

        return distribute_module(module, device_mesh, self._partition, prepare_input,
                                 prepare_output)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts[0]!r}, "
                f"output_layouts={self.output_layouts[0]!r}, "
                f"use_local_output={self.use_local_output})")


class ColwiseParallel(_ShardedLayer):
    """Shard an ``nn.Linear`` by output features (or an ``nn.Embedding`` by embedding dims).

    Args:
        input_layouts: the layout a plain-tensor input is in (default ``Replicate()``);
            the module runs on a ``Replicate`` input (redistributed if needed).
        output_layouts: the layout of the output (default ``Shard(-1)``: no communication).
        use_local_output: return this rank's local output instead of a DTensor (default True).

    Example::

        parallelize_module(mlp, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _runtime_input(self, kind: str) -> Placement:
        return Replicate()

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:
            return
        placement = Shard(0) if isinstance(module, nn.Linear) else Shard(1)
        for pname in list(module._parameters):
            distribute_param(module, pname, mesh, placement, self.src_data_rank)


class RowwiseParallel(_ShardedLayer):
    """Shard an ``nn.Linear`` by input features (or an ``nn.Embedding`` by vocabulary rows).

    Args:
        input_layouts: the layout a plain-tensor input is in (default ``Shard(-1)``); the
            module runs on ``Shard(-1)`` inputs (``Replicate`` indices for an embedding).
        output_layouts: the output's layout (default ``Replicate()``: one all-reduce;
            ``Shard(d)``: one reduce-scatter, for sequence parallelism).
        use_local_output: return this rank's local output instead of a DTensor (default True).
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _runtime_input(self, kind: str) -> Placement:
        return Shard(-1) if kind == "linear" else Replicate()

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:
            return
        if isinstance(module, nn.Linear):
            distribute_param(module, "weight", mesh, Shard(1), self.src_data_rank)
            distribute_param(module, "bias", mesh, Replicate(), self.src_data_rank)
        else:
            distribute_param(module, "weight", mesh, Shard(0), self.src_data_rank)


class SequenceParallel(ParallelStyle):
    """Run a module (``nn.LayerNorm``, an RMSNorm, ``nn.Dropout``) on activations sharded on
    ``sequence_dim``; its parameters are ``Replicate``.

    A plain-tensor input is taken as this rank's sequence shard; a DTensor input in
    another layout is redistributed to ``Shard(sequence_dim)``.  Parameters are wrapped as
    they are on each rank (no broadcast: norms start from the same values everywhere;
    broadcast custom initializations yourself).  Their gradients, partial sums over the
    local rows, are all-reduced once per backward (see [Note: TP gradient layouts]).

    Args:
        sequence_dim: the sequence dimension of the input (default 1).
        use_local_output: return the local output instead of a DTensor (default False).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname in list(module._parameters):
            distribute_param(module, pname, mesh, Replicate(), None, from_local=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout, use_local = self.sequence_sharding[0], self.use_local_output

        def prepare_input(mod: nn.Module, inputs: tuple[Any, ...],
                          mesh: DeviceMesh) -> tuple[Any, ...]:
            return (as_layout(_first_input(inputs, "SequenceParallel"), mesh, layout, layout),
                    *inputs[1:])

        def prepare_output(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            return out.to_local() if use_local and isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, self._partition, prepare_input,
                                 prepare_output)

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, "
                f"use_local_output={self.use_local_output})")
