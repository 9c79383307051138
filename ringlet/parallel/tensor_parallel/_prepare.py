"""``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``: lay out a
module's inputs and outputs without touching its parameters.

They are how a block says where its activations change layout: e.g. an attention block
with ``input_layouts=Shard(1), desired_input_layouts=Replicate()`` all-gathers the
sequence-sharded activations once, and every column-parallel projection inside consumes
that one ``Replicate`` DTensor (so backward reduces its gradient once, not once per
projection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ringlet._compile import compiler_disable
from ringlet.dtensor import DTensor, Placement
from ringlet.mesh import DeviceMesh
from ringlet.parallel.tensor_parallel._layouts import as_layout
from ringlet.parallel.tensor_parallel.style import ParallelStyle

__all__ = ["PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput"]

Layouts = Placement | Sequence[Placement | None] | None


def _as_tuple(layouts: Layouts) -> tuple[Placement | None, ...] | None:
    if layouts is None or isinstance(layouts, Placement):
        return None if layouts is None else (layouts,)
    return tuple(layouts)


def _pairs(given: tuple[Any, ...] | None, desired: tuple[Any, ...] | None, style: str,
           what: str) -> None:
    if given is None:
        return
    if desired is None or len(given) != len(desired):   # torch raises AssertionError here
        raise AssertionError(f"{style}: {what}_layouts and desired_{what}_layouts should have "
                             f"same length: expected desired_{what}_layouts with one entry per "
                             f"{what}_layouts entry ({len(given)}), got {desired!r}")


class PrepareModuleInput(ParallelStyle):
    """Turn a module's inputs into DTensors of ``input_layouts`` and redistribute them to
    ``desired_input_layouts`` before its forward.

    Args:
        input_layouts: one placement per positional input (``None`` for inputs to leave
            alone, e.g. non-tensors); a single placement for a single input.
        desired_input_layouts: the layouts the module runs on, same length.
        input_kwarg_layouts, desired_input_kwarg_layouts: the same per keyword argument.
        use_local_output: hand the module local tensors instead of DTensors (default False).

    Raises:
        ValueError: lengths differ, or (at forward) the module is called with another
            number of positional inputs.

    Example::

        PrepareModuleInput(input_layouts=(Shard(1), None),
        desired_input_layouts=(Replicate(), None))
    """

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        self.use_local_output = use_local_output
        _pairs(self.input_layouts, self.desired_input_layouts, "PrepareModuleInput", "input")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if (self.with_kwargs
                and set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts)):
            raise ValueError("PrepareModuleInput: expected desired_input_kwarg_layouts for the "
                             f"keywords {sorted(self.input_kwarg_layouts)}, got "
                             f"{sorted(self.desired_input_kwarg_layouts)}")

    def _one(self, x: Any, mesh: DeviceMesh, given: Placement | None,
             desired: Placement | None) -> Any:
        if given is None:
            return x
        x = as_layout(x, mesh, given, desired)
        return x.to_local() if self.use_local_output and isinstance(x, DTensor) else x

    def _inputs(self, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        if self.input_layouts is None:
            return inputs
        if len(inputs) != len(self.input_layouts):
            raise ValueError(f"PrepareModuleInput: expected {len(self.input_layouts)} positional "
                             f"inputs (one per input_layouts entry), got {len(inputs)}")
        desired = self.desired_input_layouts or self.input_layouts
        return tuple(self._one(x, mesh, g, d)
                     for x, g, d in zip(inputs, self.input_layouts, desired))

    def _kwargs(self, kwargs: dict[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
        return {k: self._one(v, mesh, self.input_kwarg_layouts.get(k),
                             self.desired_input_kwarg_layouts.get(k))
                for k, v in kwargs.items()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # under torch.compile the hooks run eagerly (they may redistribute: collectives)
        if self.with_kwargs:
            module.register_forward_pre_hook(compiler_disable(
                lambda _, args,
                kwargs: (self._inputs(args, device_mesh), self._kwargs(kwargs, device_mesh))),
                with_kwargs=True)
        else:
            module.register_forward_pre_hook(compiler_disable(
                lambda _, args: self._inputs(args, device_mesh)))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
                f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Turn a module's outputs into DTensors of ``output_layouts`` and redistribute them to
    ``desired_output_layouts`` after its forward.

    Args:
        output_layouts: one placement per output (``None`` to leave one alone).
        desired_output_layouts: the layouts to hand on, same length.
        use_local_output: return local tensors (default True).
    """

    def __init__(self, *, output_layouts: Layouts, desired_output_layouts: Layouts,
                 use_local_output: bool = True) -> None:
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        self.use_local_output = use_local_output
        if self.output_layouts is None:
            raise ValueError("PrepareModuleOutput: expected output_layouts, got None")
        _pairs(self.output_layouts, self.desired_output_layouts, "PrepareModuleOutput", "output")

    def _outputs(self, outputs: Any, mesh: DeviceMesh) -> Any:
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        layouts = self.output_layouts or ()
        if len(outs) != len(layouts):
            raise ValueError(f"PrepareModuleOutput: expected {len(layouts)} module outputs (one "
                             f"per output_layouts entry), got {len(outs)}")
        done = []
        for x, given, desired in zip(outs, layouts, self.desired_output_layouts or ()):
            if given is not None:
                x = as_layout(x, mesh, given, desired)
                x = x.to_local() if self.use_local_output and isinstance(x, DTensor) else x
            done.append(x)
        return done[0] if len(done) == 1 else tuple(done)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(compiler_disable(
            lambda _, inputs, outputs: self._outputs(outputs, device_mesh)))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
                f"{self.desired_output_layouts}, use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module.

    Arguments as theirs; ``use_local_input`` is the input side's ``use_local_output``.
    """

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_input: bool = False, output_layouts: Layouts,
                 desired_output_layouts: Layouts, use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInputOutput({self.prepare_module_input!r}, "
                f"{self.prepare_module_output!r})")
