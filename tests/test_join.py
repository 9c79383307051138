"""Join with a toy Joinable: uneven iteration counts, shadowing, last-joiner, early termination."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ringlet.distributed as dist
from ringlet.distributed.algorithms.join import Join, Joinable, JoinHook
from ringlet.testing import run_threads


class Counter(Joinable):
    """Each iteration all-reduces a 1; ``total`` ends as the sum over iterations of active ranks."""

    def __init__(self, group: Any = None, quiet: bool = False) -> None:
        super().__init__()
        self.group = group
        self.quiet = quiet
        self.total = torch.zeros(1)
        self.works: list[Any] = []
        self.shadowed = 0
        self.last_joiner: bool | None = None
        self.hook_kwargs: dict[str, Any] = {}

    def step(self) -> None:
        self.works.append(Join.notify_join_context(self))
        t = torch.ones(1)
        dist.all_reduce(t, group=self.group)
        self.total += t

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.hook_kwargs = kwargs
        return CounterHook(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


class CounterHook(JoinHook):
    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def main_hook(self) -> None:
        if self.counter.quiet:       # a joinable that issues no collectives shadows none
            return
        t = torch.zeros(1)           # a joined rank contributes nothing, but takes part
        dist.all_reduce(t, group=self.counter.group)
        self.counter.total += t
        self.counter.shadowed += 1

    def post_hook(self, is_last_joiner: bool) -> None:
        self.counter.last_joiner = is_last_joiner


def _uneven(rank: int, world_size: int, iters: list[int]) -> dict[str, Any]:
    c, other = Counter(), Counter(quiet=True)
    with Join([c, other], note="x"):
        for _ in range(iters[rank]):
            c.step()
    actives = [int(w.result()[0].item()) for w in c.works]
    return {"total": c.total.item(), "shadowed": c.shadowed, "last": c.last_joiner,
            "actives": actives,
            "kwargs": c.hook_kwargs, "other_works": other.works,
            "after": Join.notify_join_context(c)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("iters", [[3, 5], [2, 4, 3], [4, 4]])
def test_uneven_iterations_are_shadowed(iters: list[int]) -> None:
    n = len(iters)
    out = run_threads(_uneven, n, iters)
    expected_total = sum(sum(1 for k in iters if k > i) for i in range(max(iters)))
    for rank, r in enumerate(out):
        assert r["total"] == expected_total
        assert r["shadowed"] == max(iters) - iters[rank]
        assert r["last"] == (iters[rank] == max(iters))
        # notify's Work carries the number of ranks still active in that iteration
        assert r["actives"] == [sum(1 for k in iters if k > i) for i in range(iters[rank])]
        assert r["kwargs"] == {"note": "x"}
        assert r["after"] is None             # outside the context notify is a no-op


def _early(rank: int, world_size: int, iters: list[int]) -> str:
    c = Counter()
    try:
        with Join([c], throw_on_early_termination=True):
            for _ in range(iters[rank]):
                c.step()
    except RuntimeError as e:
        return f"raised after {len(c.works)}: {e}"
    return "no error"


@pytest.mark.timeout(30)
def test_throw_on_early_termination_raises_on_every_rank() -> None:
    out = run_threads(_early, 3, [2, 4, 5])
    assert "Rank 0 exhausted all inputs." in out[0]                         # torch's texts
    for msg in out[1:]:
        assert msg.startswith("raised after 2:")  # in the 3rd notify
        assert "Detected at least one rank that exhausted inputs." in msg


def _disabled(rank: int, world_size: int) -> tuple[Any, float]:
    c = Counter()
    with Join([c], enable=False):
        for _ in range(3):
            c.step()
    return c.works, c.total.item()


@pytest.mark.timeout(30)
def test_disabled_join_does_nothing() -> None:
    for works, total in run_threads(_disabled, 2):
        assert works == [None] * 3 and total == 6.0


def _error_inside(rank: int, world_size: int) -> str:
    c = Counter()
    try:
        with Join([c]):
            c.step()
            raise KeyError("boom")
    except KeyError:
        pass
    return repr(Join.notify_join_context(c))


@pytest.mark.timeout(30)
def test_error_in_body_propagates_without_shadowing() -> None:
    assert run_threads(_error_inside, 2) == ["None", "None"]


def _subgroup(rank: int, world_size: int) -> float:
    g = dist.new_group([1, 2])
    if rank == 0:
        return -1.0
    c = Counter(g)
    with Join([c]):
        for _ in range(rank):
            c.step()
    return c.total.item()


@pytest.mark.timeout(30)
def test_join_on_a_subgroup() -> None:
    assert run_threads(_subgroup, 3) == [-1.0, 3.0, 3.0]


class _Forgetful(Counter):
    def __init__(self) -> None:  # does not call Joinable.__init__
        self.group = None
        self.quiet = True


def _bad_arguments(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="at least one joinable"):
        Join([])
    with pytest.raises(TypeError, match="expected Joinable objects"):
        Join([object()])  # type: ignore[list-item]
    g = dist.new_group([0, 1])
    with pytest.raises(ValueError, match="one process group"):
        Join([Counter(), Counter(g)])
    with pytest.raises(AttributeError, match="Joinable.__init__"):
        Join.notify_join_context(_Forgetful())


@pytest.mark.timeout(30)
def test_bad_arguments() -> None:
    run_threads(_bad_arguments, 2)
