"""Hostile tensors for tests/test_security_objects.py and the rank bodies that send them.

Each entry of :func:`hostile_tensors` is an object whose ``torch.save`` pickle rebuilds, on the
receiver, a tensor with out-of-range indices or a view outside its storage.  The sender needs no
trick: ``torch.save`` writes what ``__reduce_ex__`` returns, and every callable named is one that
``torch.load(weights_only=True)`` allows.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch._utils as U

import ringlet.distributed as dist


class _Rebuild:
    """Pickles as ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce_ex__(self, protocol: int) -> Any:
        return (self.fn, self.args)


class _Built(_Rebuild):
    """Pickles as ``fn(*args)`` followed by ``BUILD state`` (a tensor's legacy ``set_(*state)``)."""

    def __init__(self, fn: Any, args: tuple[Any, ...], state: Any) -> None:
        super().__init__(fn, *args)
        self.state = state

    def __reduce_ex__(self, protocol: int) -> Any:
        return (self.fn, self.args, self.state)


def _csr_issue() -> torch.Tensor:
    """The tensor of the report: CSR built without checking, column indices out of range."""
    return torch.sparse_csr_tensor(torch.tensor([0, 2, 4]), torch.tensor([0, 10**8, 5, -7]),
                                   torch.ones(4), (2, 3), check_invariants=False)


def _storage(n: int = 4, dtype: torch.dtype = torch.float32) -> torch.storage.TypedStorage:
    t = torch.ones(n, dtype=torch.uint8 if dtype == torch.quint8 else dtype)
    return torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=dtype, _internal=True)


def _compressed(layout: torch.layout) -> _Rebuild:
    bad = (torch.tensor([0, 1, 2]), torch.tensor([0, 10**6]))
    return _Rebuild(U._rebuild_sparse_tensor, layout, (*bad, torch.ones(2, 1, 1), (2, 2)))


def sparse_tensors() -> dict[str, Any]:
    """Sparse tensors (every layout) whose indices break their invariants."""
    od = collections.OrderedDict
    bad_coo = _Rebuild(U._rebuild_sparse_tensor, torch.sparse_coo,
                       (torch.tensor([[10**9]]), torch.ones(1), (6,), False))
    return {
        "csr (the report)": _csr_issue(),
        "csc": torch.sparse_csc_tensor(torch.tensor([0, 2, 4]), torch.tensor([0, 10**8, 5, -7]),
                                       torch.ones(4), (3, 2), check_invariants=False),
        "bsr": _compressed(torch.sparse_bsr),
        "bsc": _compressed(torch.sparse_bsc),
        "coo out of range": bad_coo,
        "coo negative index": _Rebuild(U._rebuild_sparse_tensor, torch.sparse_coo,
                                       (torch.tensor([[-3]]), torch.ones(1), (6,), False)),
        "coo claims coalesced": _Rebuild(U._rebuild_sparse_tensor, torch.sparse_coo,
                                         (torch.tensor([[5, 0, 5]]), torch.ones(3), (6,), True)),
        "legacy sparse class": _Rebuild(torch.sparse.FloatTensor, torch.tensor([[10**9]]),
                                        torch.ones(1), torch.Size([6])),
        "converted while loading": _Rebuild(U._rebuild_device_tensor_from_cpu_tensor,
                                            _csr_issue(), torch.float64, "cpu", False),
        "inside a parameter": _Rebuild(U._rebuild_parameter, bad_coo, False, od()),
        "deep in containers": {"a": [({"b": (_csr_issue(),)},)]},
    }


def strided_tensors() -> dict[str, Any]:
    """Views outside their storage: strided, legacy, quantized and nested rebuilds."""
    od = collections.OrderedDict
    q = (torch.per_tensor_affine, 1.0, 0)
    return {
        "offset past the end": _Rebuild(U._rebuild_tensor_v2, _storage(), 1000, (4,), (1,),
                                        False, od()),
        "size past the end": _Rebuild(U._rebuild_tensor_v2, _storage(), 0, (1000,), (1,), False,
                                      od()),
        "stride past the end": _Rebuild(U._rebuild_tensor_v2, _storage(), 0, (4,), (1000,), False,
                                        od()),
        "negative stride": _Rebuild(U._rebuild_tensor_v2, _storage(), 3, (4,), (-1000,), False,
                                    od()),
        "negative offset": _Rebuild(U._rebuild_tensor_v2, _storage(), -5, (4,), (1,), False, od()),
        "overflowing sizes": _Rebuild(U._rebuild_tensor_v2, _storage(), 0, (2**33, 2**33),
                                      (2**31, 2**31), False, od()),
        "legacy rebuild": _Rebuild(U._rebuild_tensor, _storage(), 1000, (4,), (1,)),
        "v3 wider dtype": _Rebuild(U._rebuild_tensor_v3, _storage(), 0, (4,), (1,), False, od(),
                                   torch.complex128),
        "quantized": _Rebuild(U._rebuild_qtensor, _storage(4, torch.quint8), 0, (1000,), (1,), q,
                              False, od()),
        "nested offsets": _Rebuild(U._rebuild_nested_tensor, torch.ones(4),
                                   torch.tensor([[2], [2]]), torch.tensor([[1], [1]]),
                                   torch.tensor([0, 1000])),
        "nested sizes": _Rebuild(U._rebuild_nested_tensor, torch.ones(4),
                                 torch.tensor([[2000], [2]]), torch.tensor([[1], [1]]),
                                 torch.tensor([0, 1])),
        "legacy set_ state": _Built(torch.Tensor, (), (_storage(), 1000, (4,), (1,))),
        "wrapper subclass": _Rebuild(U._rebuild_wrapper_subclass, torch.Tensor, torch.float32,
                                     (1000,), (1,), 0, torch.strided, torch.device("cpu"), False),
    }


def _use(obj: Any) -> str:
    """What a careless receiver does with what it got: densify and sum every tensor."""
    stack, total = [obj], 0.0
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
        elif isinstance(o, torch.Tensor):
            t = o.to_dense() if o.layout != torch.strided else o
            t = t.dequantize() if t.is_quantized else t
            if t.device.type != "meta":
                total += float(t.sum()) if not t.is_nested else sum(float(x.sum()) for x in t)
    return f"ACCEPTED (sum {total})"


def hostile_round(rank: int, n: int, kind: str) -> list[str]:
    """Rank 0 broadcasts each hostile tensor in turn; rank 1 reports what happened to each, then
    both check that a valid sparse tensor still arrives (the group is still usable)."""
    corpus = sparse_tensors() if kind == "sparse" else strided_tensors()
    outcomes = []
    for name, obj in corpus.items():
        objs = [obj if rank == 0 else None]
        try:
            dist.broadcast_object_list(objs, src=0)
            outcomes.append(f"{name}: sent" if rank == 0 else f"{name}: {_use(objs[0])}")
        except Exception as e:  # the outcome is the test's evidence
            outcomes.append(f"{name}: {type(e).__name__}: {e}")
    good = [torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.tensor([2.0, 3.0]), (6,))
            if rank == 0 else None]
    dist.broadcast_object_list(good, src=0)
    outcomes.append(f"valid: {good[0].to_dense().tolist()}")
    return outcomes


def bad_list_round(rank: int, n: int, bad_rank: int) -> list[str]:
    """``bad_rank`` passes None as object_list; every rank reports its error, then the group
    carries one more broadcast and an all_reduce."""
    out = []
    try:
        dist.broadcast_object_list(None if rank == bad_rank else [rank], src=0)  # type: ignore[arg-type]
        out.append("ok")
    except Exception as e:  # the outcome is the test's evidence
        out.append(f"{type(e).__name__}: {e}")
    objs: list[Any] = [f"from {rank}"]
    dist.broadcast_object_list(objs, src=0)
    t = torch.ones(1)
    dist.all_reduce(t)
    out.append(f"{objs[0]} {t.item()}")
    return out
