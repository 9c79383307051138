"""``SyncBatchNorm``: batch normalization with statistics over the whole group's batch.

In training, each rank computes per-channel (count, mean, sum of squared
deviations) of its own batch, the group all-gathers them (one collective of
``2C + 1`` values per rank) and every rank combines them with Chan et al.'s
parallel-variance formula (stable where sum / sum-of-squares cancels).  So the
output equals ``BatchNorm`` over the concatenation of all ranks' batches, for
any batch sizes per rank, zero included.  Backward all-reduces the two
per-channel sums the input gradient needs (``Σ dy`` and ``Σ dy·(x - mean)``);
weight and bias gradients stay local, like any other parameter's (DDP averages
them).  Evaluation uses the running statistics and communicates nothing.

Unlike torch's, this one runs on CPU tensors (torch's refuses them).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ringlet.c10d import all_gather_into_tensor, all_reduce
from ringlet.c10d import world as _world
from ringlet.c10d.group import GroupArg, ProcessGroup

__all__ = ["SyncBatchNorm"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def _group_stats(x: torch.Tensor, pg: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean and biased variance per channel over every rank's batch, and the total count."""
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    acc = _acc_dtype(x.dtype)
    n_local = x.numel() // c
    mine = torch.zeros(2 * c + 1, dtype=acc, device=x.device)
    if n_local > 0:
        xf = x.to(acc)
        mean = xf.mean(dims)
        mine[:c] = mean
        mine[c:2 * c] = (xf - mean.view(_channel_shape(x))).square().sum(dims)
    mine[2 * c] = n_local
    everyone = torch.empty(pg.size() * (2 * c + 1), dtype=acc, device=x.device)
    all_gather_into_tensor(everyone, mine, group=pg)
    table = everyone.view(pg.size(), 2 * c + 1)
    means, m2s, counts = table[:, :c], table[:, c:2 * c], table[:, 2 * c:]
    total = int(counts.sum().item())
    if total <= 1:
        raise ValueError("SyncBatchNorm: expected more than 1 value per channel across the group "
                         f"when training, got {total} (batch sizes per rank "
                         f"{counts.flatten().long().tolist()})")
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return mean, m2 / total, total


class _SyncBatchNormFn(torch.autograd.Function):
    """Forward: normalize with the group's statistics; backward: all-reduce
    the two gradient sums."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float,
                factor: float, pg: ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        mean, var, total = _group_stats(x, pg)
        if running_mean is not None and running_var is not None:
            # Running variance is the unbiased estimate over the whole
            # group's batch (as BatchNorm's).
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((var * total / (total - 1)).to(running_var.dtype),
                                              alpha=factor)
        invstd = torch.rsqrt(var + eps)
        shape = _channel_shape(x)
        y = (x.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.to(y.dtype).view(shape)
        if bias is not None:
            y = y + bias.to(y.dtype).view(shape)
        ctx.save_for_backward(x, mean, invstd, *([] if weight is None else [weight]))
        ctx.total = total        # type: ignore[attr-defined]
        ctx.pg = pg              # type: ignore[attr-defined]
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, invstd, *rest = ctx.saved_tensors
        weight = rest[0] if rest else None
        shape = _channel_shape(x)
        dims = [0, *range(2, x.dim())]
        dy = grad_out.to(mean.dtype)
        xmu = x.to(mean.dtype) - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_w = ((sum_dy_xmu * invstd).to(weight.dtype) if weight is not None
                  and ctx.needs_input_grad[1] else None)
        grad_b = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            all_reduce(sums, group=ctx.pg)
            c = mean.numel()
            g_dy, g_dy_xmu = sums[:c] / ctx.total, sums[c:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = ((dy - g_dy.view(shape) - xmu * (invstd.square() * g_dy_xmu).view(shape))
                      * scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over N-D input (N, C, ...) with statistics shared by a process group.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance for numerical stability.
        momentum: weight of the current batch in the running statistics; None for a
            cumulative average.
        affine: learnable per-channel weight and bias.
        track_running_stats: keep running mean/variance (used in eval mode); without
            them eval mode normalizes each rank's batch with its own statistics.
        process_group: the group whose ranks share statistics; None for the default group
            (looked up at each forward).
        device, dtype: of the parameters and buffers.

    Raises:
        ValueError: input with fewer than 2 dims, zero channels, or a single value per
            channel across the group in training.

    Example::

        model = SyncBatchNorm.convert_sync_batchnorm(model)   # every BatchNorm*d
        out = model(x)                                          # stats over all ranks' x
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: GroupArg = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError("SyncBatchNorm: expected at least 2-D input (N, C, ...), "
                             f"got {input.dim()}-D input")

    def _factor(self) -> float:
        """Weight of this batch in the running statistics (counts the batch when tracking)."""
        if not (self.training and self.track_running_stats):
            return 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm: expected a non-zero number of input channels, got 0")
        factor = self._factor()
        # Batch statistics in training, or in eval when there are no running stats to use.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        pg = self._sync_group() if self.training and use_batch_stats else None
        if pg is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var,
                                      self.eps, factor, pg)

    def _sync_group(self) -> ProcessGroup | None:
        """The group to share statistics with, or None when there is nobody to share with."""
        if self.process_group is None and not _world.is_initialized():
            return None
        pg = _world.resolve_group(self.process_group)
        if pg is None:
            raise ValueError("SyncBatchNorm: expected a process_group this rank is a member "
                             "of, got a non-member group")
        return pg if pg.size() > 1 else None

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        # A process group is a shared live handle (threads, shared memory): copies share it.
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: GroupArg = None) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` (recursively) by a :class:`SyncBatchNorm`.

        The new layers share the old ones' parameters (so ``requires_grad`` and an
        optimizer that already holds them carry over) and running buffers, and keep
        their training mode.  Returns the converted module (``module`` itself unless
        it is a batch norm layer).

        Example::

            model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
            model = SyncBatchNorm.convert_sync_batchnorm(model, process_group=None)
        """
        out = module
        if isinstance(module, _BatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group)
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out
