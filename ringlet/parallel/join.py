"""``Join``: training with uneven inputs across ranks.

A rank that runs out of inputs before its peers would otherwise stop calling
the collectives its peers still issue (DDP's gradient all-reduce, ZeRO's
parameter broadcasts), and they would wait until their timeout.  Inside a
``Join`` context such a rank *shadows* those collectives instead: every
joinable object hands out a :class:`JoinHook` whose ``main_hook`` issues the
same collectives with neutral contributions, and runs it until every rank is
done.

[Note: the join protocol]  Every iteration, each still-active rank calls
``Join.notify_join_context(first_joinable)``, which all-reduces a ``1`` ("I am
active") on the joinables' group.  A rank that has left the ``with`` body
all-reduces a ``0`` in the same position, so the sum is the number of active
ranks, which every rank sees.  While it is non-zero, the joined rank runs each
joinable's ``main_hook`` (one shadow iteration) and all-reduces again; once it
is zero every rank has joined and each runs ``post_hook(is_last_joiner)``.
With ``throw_on_early_termination=True`` the active ranks follow the "I am
active" all-reduce by a second one that the joined rank answers with a ``1``,
so every rank raises in the same iteration instead of shadowing.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, Self

import torch

from ringlet.c10d import all_reduce
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.work import Work
from ringlet.c10d.world import resolve_group

__all__ = ["Join", "JoinHook", "Joinable"]

logger = logging.getLogger(__name__)

# Shadow iterations after which a joined rank logs that it is still waiting (a hint that the
# ranks' input counts differ a lot, or that one rank never leaves its loop).
_WARN_AFTER = 1000


class JoinHook:
    """What a joined rank does for one :class:`Joinable` while other ranks still train.

    Subclass it and override either method; the defaults do nothing.

    - ``main_hook()`` runs once per iteration that some rank is still active in:
      it must issue the same collectives, in the same order, as one iteration of
      the joinable on an active rank.
    - ``post_hook(is_last_joiner)`` runs once on every rank after all ranks joined;
      ``is_last_joiner`` is True on the rank(s) that joined last.
    """

    def main_hook(self) -> None:
        """Shadow one iteration of the joinable's collectives."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Finish up after every rank joined (e.g. sync final state from the last joiner)."""


@dataclasses.dataclass(frozen=True)
class _JoinConfig:
    """How a joinable takes part in the current Join context (disabled outside one)."""

    enable: bool = False
    throw_on_early_termination: bool = False
    is_first_joinable: bool = False


class Joinable(ABC):
    """An object whose per-iteration collectives a joined rank can shadow.

    Subclasses call ``super().__init__()``, call ``Join.notify_join_context(self)``
    once per iteration (before their own collectives), and implement
    :meth:`join_hook`, :attr:`join_device` and :attr:`join_process_group`.
    """

    def __init__(self) -> None:
        self._join_config = _JoinConfig()

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the :class:`JoinHook` that shadows this object's collectives.

        ``kwargs`` are the keyword arguments given to :class:`Join`.
        """

    @property
    @abstractmethod
    def join_device(self) -> torch.device:
        """Device of the tensors used by the join protocol's all-reduces."""

    @property
    @abstractmethod
    def join_process_group(self) -> GroupArg:
        """Process group (or None for the default group) the object communicates on."""


def _member_group(group: GroupArg, what: str) -> ProcessGroup:
    pg = resolve_group(group)
    if pg is None:
        raise ValueError(f"Join: expected {what} to be a group this rank is a member "
                         "of, got a non-member group")
    return pg


class Join:
    """Context manager that lets ranks with fewer inputs shadow the ones still training.

    Args:
        joinables: the :class:`Joinable` objects used in the loop (e.g. the DDP model
            and a ``ZeroRedundancyOptimizer``), all on one process group and device.
            The first one sends the per-iteration "still active" signal.
        enable: False turns the context into a no-op (same code path with even inputs).
        throw_on_early_termination: raise ``RuntimeError`` on every rank as soon as
            one rank runs out of inputs, instead of shadowing.
        **kwargs: passed to every joinable's ``join_hook()`` (for instance DDP's
            ``divide_by_initial_world_size``).

    Raises:
        ValueError: no joinables, or joinables on different groups or devices.
        TypeError: an object that is not a :class:`Joinable`.
        RuntimeError: with ``throw_on_early_termination=True``, once any rank joined.

    Example::

        with Join([model, optimizer]):
            for batch in my_uneven_batches:
                loss = model(batch).sum(); loss.backward()
                optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, joinables: list[Joinable], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs: Any) -> None:
        joinables = list(joinables)
        if not joinables:
            raise ValueError("Join: expected at least one joinable, got an empty list")
        for j in joinables:
            if not isinstance(j, Joinable):
                raise TypeError(f"Join: expected Joinable objects, got {type(j).__name__}")
        self._joinables = joinables
        self._enable = enable
        self._throw = throw_on_early_termination
        self._hooks = [j.join_hook(**kwargs) for j in joinables]
        self._pg = _member_group(joinables[0].join_process_group, "the joinables' process group")
        self._device = torch.device(joinables[0].join_device)
        for j in joinables[1:]:
            if _member_group(j.join_process_group, "the joinables' process group") is not self._pg:
                raise ValueError("Join: expected all joinables on one process group, got "
                                 f"{self._pg!r} for {type(joinables[0]).__name__} and "
                                 f"{j.join_process_group!r} for {type(j).__name__}")
            if torch.device(j.join_device) != self._device:
                raise ValueError(f"Join: expected all joinables on one device, got {self._device} "
                                 f"and {j.join_device} ({type(j).__name__})")

    def _set_configs(self, enable: bool) -> None:
        for i, j in enumerate(self._joinables):
            j._join_config = _JoinConfig(enable, self._throw, i == 0) if enable else _JoinConfig()

    def __enter__(self) -> Self:
        self._set_configs(self._enable)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Outside the context, notify_join_context is a no-op again (torch leaves it armed).
        self._set_configs(False)
        if not self._enable or exc_type is not None:
            return        # an error inside the body propagates; nothing to shadow
        self._shadow_until_all_joined()

    def _active_ranks(self) -> int:
        """This rank's "joined" vote: the sum is the number of ranks still in their loop."""
        flag = torch.zeros(1, device=self._device)
        all_reduce(flag, group=self._pg)
        return int(flag.item())

    def _shadow_until_all_joined(self) -> None:
        is_last_joiner = True
        rounds = 0
        while True:      # each round's all-reduce is bounded by the group's op deadline
            active = self._active_ranks()
            if active == 0:
                break
            if self._throw:
                self._tell_active_ranks_to_stop()
            for hook in self._hooks:
                hook.main_hook()
            is_last_joiner = False
            rounds += 1
            if rounds == _WARN_AFTER:
                logger.warning("Join: rank %d has shadowed %d iterations of %d still-active "
                               "rank(s); are the inputs very uneven?",
                               self._global_rank(), rounds, active)
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    def _global_rank(self) -> int:
        return self._pg.ranks[self._pg.rank()]

    def _tell_active_ranks_to_stop(self) -> None:
        # Answers the active ranks' second all-reduce in notify_join_context (see the module note).
        flag = torch.ones(1, device=self._device)
        all_reduce(flag, group=self._pg)
        raise RuntimeError(f"Rank {self._global_rank()} exhausted all inputs. (Join: "
                           "this rank ran out of inputs first; "
                           "throw_on_early_termination=True raises on every rank)")

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Tell the ranks that already joined that this rank is still active.

        Call it once per iteration from the joinable, before its own collectives.
        Returns the :class:`Work` of the async "still active" all-reduce (its
        ``result()[0]`` is the number of active ranks) for the first joinable of
        an enabled Join context, and None otherwise.

        Raises:
            RuntimeError: with ``throw_on_early_termination=True``, when a rank joined.
            AttributeError: the joinable did not call ``Joinable.__init__``.
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise AttributeError(f"Join.notify_join_context: expected {type(joinable).__name__} to "
                                 "call Joinable.__init__() in its constructor, got no join config")
        if not (config.enable and config.is_first_joinable):
            return None
        pg = _member_group(joinable.join_process_group, "the joinable's process group")
        device = joinable.join_device
        work = all_reduce(torch.ones(1, device=device), group=pg, async_op=True)
        if config.throw_on_early_termination:
            stop = torch.zeros(1, device=device)
            all_reduce(stop, group=pg)
            if stop.item() > 0:
                raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing "
                                   "across all ranks. (Join: throw_on_early_termination=True)")
        return work
