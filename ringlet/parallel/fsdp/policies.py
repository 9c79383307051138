"""fully_shard's configuration: mixed precision and offload policies (frozen, keyword-only)."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"MixedPrecisionPolicy: {name}: expected None or a floating-point "
                        f"torch.dtype, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision for :func:`fully_shard`.

    The sharded parameters keep their own dtype (what the optimizer sees); the
    all-gather, the unsharded parameters and hence forward/backward compute use
    ``param_dtype``; gradients are reduced in ``reduce_dtype`` and stored in the
    sharded parameter's dtype.

    Args:
        param_dtype: dtype of the all-gather and of compute (``None``: the parameter's own).
        reduce_dtype: dtype of the gradient reduce-scatter / all-reduce (``None``: ``param_dtype``);
            also the dtype in which gradients accumulate while gradient sync is off.
        output_dtype: dtype to cast floating-point forward outputs to (``None``: no cast).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.

    Raises:
        TypeError: a dtype that is not a floating-point ``torch.dtype``.

    Example::

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(block, mp_policy=mp)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy: cast_forward_inputs: expected a bool, "
                            f"got {self.cast_forward_inputs!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """No offloading (the default): sharded parameters, gradients and optimizer
    state stay where they are."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the CPU.

    On a CUDA mesh the shards and their ``.grad`` stay in CPU memory (so the optimizer steps
    there); each all-gather copies the shard to the GPU first and each reduced gradient shard is
    copied back.  On a CPU mesh everything already lives on the CPU: the policy changes nothing.

    Args:
        pin_memory: pin the CPU copies (faster, non-blocking copies to the GPU; CUDA only).

    Raises:
        TypeError: ``pin_memory`` is not a bool.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError("CPUOffloadPolicy: pin_memory: expected a "
                            f"bool, got {self.pin_memory!r}")
