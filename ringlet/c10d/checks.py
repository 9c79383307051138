"""The one gate every collective and point-to-point op passes before any byte moves.

[Note: the validation gate]
``collectives.py``, ``p2p.py`` (and through them the object collectives,
DTensor, DDP and FSDP) hand every user tensor to :func:`tensor` or
:func:`tensor_list` and every rank to :func:`root` / :func:`peer` before they
allocate a sequence number.  A refused call therefore raises on the calling
rank at once (docs/reliability.md, row C7), nothing reaches a peer, and the group stays
usable.  What is proven here is what the transports rely on when they
``memmove`` to or from ``data_ptr()`` (``arena_algos``) or wrap it in a
``memoryview`` (``tcp.pump.mv``):

- a plain dense tensor (no wrapper subclass such as DTensor, no meta, sparse,
  quantized, mkldnn or nested tensor) on a device the transport serves, of a
  dtype it can carry;
- real storage: ``data_ptr() != 0`` whenever there are elements, and every
  element of the view inside its storage's ``nbytes`` (a storage resized to
  0 bytes, as FSDP does to free parameters, is refused, not dereferenced);
- memory that may be read, and for outputs written (``_memory``: read-only
  mappings, truncated file mappings, ``bytes`` objects);
- outputs whose elements do not overlap (an ``expand``ed view cannot receive).

Ops that run later on a communication thread prove the bounds again just
before the transport runs (:func:`reprove`), because a storage may be resized
between the call and the run.  Errors are worded "op: argument: expected ...,
got ..." and carry the rank.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import _memory
from ringlet.c10d._current import current_world
from ringlet.c10d.reduce_op import resolve_op
from ringlet.transport.base import DTYPE_CODES
from ringlet.transport.reduce import RedOpType, check_op_dtype

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = [
    "Staged", "blocks", "contiguous_input", "dense", "op_dtype", "peer", "plain", "reduce_op",
    "reprove", "root", "same_dtype", "split_sizes", "tag", "tensor", "tensor_list", "writable",
]

_SUPPORTED = frozenset(DTYPE_CODES)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_BASE_DISPATCH = torch.Tensor.__torch_dispatch__
_STRIDED = torch.strided
# Only complex tensors carry a conjugate bit (conj() of a real tensor is the tensor itself), so
# is_conj() (~80 ns) is asked only of these.
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})
_PREMUL_SUM = RedOpType.PREMUL_SUM
_OVERLAP_ENUM_MAX = 1 << 20     # elements up to which an odd view's overlap is checked exactly


def _who() -> str:
    w = current_world(required=False)
    return f"[rank {w.rank}] " if w is not None else ""


def fail(exc: type[Exception], op: str, arg: str, what: str) -> Exception:
    """The error for a refused argument: ``[rank r] op: arg: what``."""
    return exc(f"{_who()}{op}: {arg}: {what}")


# -- tensors ------------------------------------------------------------------------------
def tensor(t: Any, op: str, arg: str, devices: tuple[str, ...] = ("cpu",), *,
           out: bool = False) -> torch.Tensor:
    """Prove ``t`` can be handed to a transport (see the note); ``out``:
    results are written into it.

    Returns the tensor to communicate: ``t`` itself, or a plain-``Tensor`` alias of a
    harmless subclass (so that no ``__torch_function__`` runs inside a transport).
    """
    return _gate(t, op, arg, devices, out)[0]


def dense(t: Any, op: str, arg: str, devices: tuple[str, ...] = ("cpu",), *,
          out: bool = False) -> tuple[torch.Tensor, bool]:
    """:func:`tensor` and :func:`plain` in one pass: (the tensor to communicate, whether a
    transport may use its memory as it is).  The latency path of a collective: each tensor
    attribute read costs ~50 ns here, and this reads each once."""
    t, contiguous = _gate(t, op, arg, devices, out)
    return t, contiguous and _bytes_as_is(t)


def _gate(t: Any, op: str, arg: str, devices: tuple[str, ...], out: bool,
          ) -> tuple[torch.Tensor, bool]:
    """:func:`tensor`'s checks; (the tensor, whether it is contiguous and not empty)."""
    if type(t) not in _PLAIN:
        t = _plain(t, op, arg)
    if t.dtype not in _SUPPORTED or t.layout is not _STRIDED or t.is_nested:
        _refuse_kind(t, op, arg)
    cpu = t.is_cpu
    if not cpu:
        _device(t, op, arg, devices)
    n = t.numel()
    if not n:                     # empty: nothing is read or written (and never plain)
        return t, False
    return t, _storage(t, op, arg, out, n, cpu)


def tensor_list(ts: Any, op: str, arg: str, length: int | None = None,
                devices: tuple[str, ...] = ("cpu",), *, out: bool = False,
                dtype: torch.dtype | None = None, like: str = "the input") -> list[torch.Tensor]:
    """:func:`tensor` for each entry of a non-empty list (``length`` entries if given), all of
    ``dtype`` when given."""
    if not isinstance(ts, (list, tuple)):
        raise fail(TypeError, op, arg, f"expected a list of tensors, got {type(ts).__name__}")
    if length is not None and len(ts) != length:
        raise fail(ValueError, op, arg, f"expected {length} tensors (one per rank of the group), "
                   f"got {len(ts)}")
    if not ts:
        raise fail(ValueError, op, arg, "expected a non-empty list of tensors, got an empty list")
    checked = [tensor(t, op, f"{arg}[{i}]", devices, out=out) for i, t in enumerate(ts)]
    if dtype is not None:
        same_dtype(op, dtype, checked, arg, like)
    return checked


# The stand-ins of torch.compile's tracers (AOT autograd, fake tensor propagation).
_TRACING_TENSORS = frozenset({"FunctionalTensor", "FakeTensor"})


def _plain(t: Any, op: str, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise fail(TypeError, op, arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        raise fail(TypeError, op, arg, "expected a plain torch.Tensor, got a DTensor: collectives "
                   "move one rank's local data, so pass dtensor.to_local() (this rank's shard), or "
                   "use DTensor's own redistribute() / full_tensor() to change its placement")
    if isinstance(t, torch.nn.UninitializedParameter | torch.nn.UninitializedBuffer):
        raise fail(ValueError, op, arg, "expected a materialized tensor, got an uninitialized lazy "
                   "parameter (run a forward pass or materialize() it first)")
    if type(t).__torch_dispatch__ is not _BASE_DISPATCH:
        if type(t).__name__ in _TRACING_TENSORS:
            raise fail(TypeError, op, arg, f"expected a real tensor, got a {type(t).__name__}: "
                       "torch.compile is tracing this collective, which it cannot compile "
                       "(ringlet's collectives are not traceable ops; DTensor's are); call it "
                       "outside the compiled function (e.g. in a torch.compiler.disable'd helper) "
                       "or use torch.compile(..., backend='eager')")
        raise fail(TypeError, op, arg, f"expected a plain torch.Tensor, got the tensor subclass "
                   f"{type(t).__name__}, whose storage does not hold its values (it defines "
                   "__torch_dispatch__); pass the plain tensor that holds this rank's data")
    return t.as_subclass(torch.Tensor)


def _refuse_kind(t: torch.Tensor, op: str, arg: str) -> None:
    """Raise for a tensor that is not dense or whose dtype no transport carries."""
    if t.layout is not torch.strided or t.is_nested or t.is_quantized:
        raise _layout_error(t, op, arg)
    raise fail(TypeError, op, arg, "expected one of the dtypes a transport carries "
               f"({', '.join(sorted(str(d).removeprefix('torch.') for d in _SUPPORTED))}), "
               f"got {t.dtype}")


def _layout_error(t: torch.Tensor, op: str, arg: str) -> Exception:
    if t.is_nested:
        got, hint = "a nested tensor", "pass its components (t.unbind()) or a padded dense tensor"
    elif t.is_quantized:
        got, hint = f"a quantized tensor ({t.dtype})", "pass t.dequantize() or t.int_repr()"
    elif t.layout is torch._mkldnn:   # type: ignore[attr-defined]
        got, hint = "an mkldnn tensor", "pass t.to_dense()"
    else:
        got, hint = f"layout {t.layout}", "pass t.to_dense()"
    return fail(ValueError, op, arg, f"expected a dense (strided) tensor, got {got}; {hint}")


def _device(t: torch.Tensor, op: str, arg: str, devices: tuple[str, ...]) -> None:
    kind = t.device.type
    if kind == "meta":
        raise fail(ValueError, op, arg, "expected a tensor with data, got a meta tensor (it has "
                   "shape and dtype but no memory); allocate it on a real device first")
    if kind not in devices:
        raise fail(ValueError, op, arg, f"expected a tensor on {' or '.join(devices)} (what this "
                   f"group's transport serves), got device {t.device}")


def _extent(t: torch.Tensor) -> int:
    """Elements of the storage spanned by the (non-empty) view, from its offset."""
    if t.is_contiguous():
        return t.numel()
    return 1 + sum((s - 1) * d for s, d in zip(t.shape, t.stride()))


def _storage(t: torch.Tensor, op: str, arg: str, out: bool, n: int, cpu: bool) -> bool:
    """Bounds and memory of a non-empty tensor of ``n`` elements; returns whether it is
    contiguous (what the caller would otherwise ask torch again)."""
    if t.data_ptr() == 0:
        raise fail(ValueError, op, arg, f"expected a tensor with storage, got {_describe(t)} whose "
                   "data pointer is 0 (its storage was freed or resized to 0 bytes)")
    contiguous = t.is_contiguous()
    if contiguous:                # the common case: no negative strides, no overlap possible
        span = n
    else:
        if min(t.stride()) < 0:
            raise fail(ValueError, op, arg, f"expected non-negative strides, got {t.stride()}")
        if out:
            writable(t, op, arg)
        span = _extent(t)
    st = t.untyped_storage()
    need = (t.storage_offset() + span) * t.element_size()
    if need > st.nbytes():
        raise fail(ValueError, op, arg, f"expected a view inside its storage, got {_describe(t)} "
                   f"at offset {t.storage_offset()} spanning {need} bytes of a storage of "
                   f"{st.nbytes()} bytes (resized after the view was made?)")
    if cpu and not st.resizable():
        why = _memory.refusal(st, out)
        if why:
            role = "an output" if out else "an input"
            raise fail(ValueError, op, arg, "expected memory that can be "
                       f"{'written' if out else 'read'} ({role}), but {why}")
    return contiguous


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def writable(t: torch.Tensor, op: str, arg: str) -> None:
    """Refuse an output view whose elements share memory (results would collide)."""
    state = torch._debug_has_internal_overlap(t)
    if state == 0 or (state == 2 and _provably_disjoint(t)):
        return
    raise fail(ValueError, op, arg, f"expected a tensor whose elements do not overlap, got a view "
               f"with strides {t.stride()} for shape {list(t.shape)} (an expanded view cannot "
               "receive results); pass a tensor with its own storage, e.g. t.clone()")


def _provably_disjoint(t: torch.Tensor) -> bool:
    """For views torch calls "too hard": dims sorted by stride each step past everything below
    them (sufficient), else an exact count of distinct offsets for views up to a size."""
    reach = 0
    dims = sorted((d, s) for s, d in zip(t.shape, t.stride()) if s > 1)
    if all(d > reach and (reach := reach + (s - 1) * d) >= 0 for d, s in dims):
        return True
    if t.numel() > _OVERLAP_ENUM_MAX:
        return False
    offsets = torch.zeros((), dtype=torch.int64).expand(t.shape).clone()
    for dim, (s, d) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = s
        offsets += (torch.arange(s, dtype=torch.int64) * d).reshape(shape)
    return int(torch.unique(offsets).numel()) == t.numel()


def same_dtype(op: str, want: torch.dtype, ts: list[torch.Tensor], arg: str,
               like: str = "the input") -> None:
    for i, t in enumerate(ts):
        if t.dtype != want:
            raise fail(TypeError, op, f"{arg}[{i}]",
                       f"expected dtype {want} (like {like}), got {t.dtype}")


def blocks(big: torch.Tensor, big_arg: str, small: torch.Tensor, small_arg: str, n: int,
           op: str) -> None:
    """``big`` must hold ``n`` blocks shaped like ``small`` (all_gather_into_tensor,
    reduce_scatter_tensor)."""
    if big.dtype != small.dtype:
        raise fail(TypeError, op, big_arg, f"expected dtype {small.dtype} (like "
                   f"{small_arg}), got {big.dtype}")
    if big.numel() != n * small.numel():
        raise fail(ValueError, op, big_arg, f"expected {n} x {small.numel()} = {n * small.numel()} "
                   f"elements (world size x {small_arg}), got {big.numel()}")


def plain(t: torch.Tensor) -> bool:
    """Whether a transport may use ``t``'s memory as it is: contiguous, no conjugate/negative
    bit, and strides that byte views accept (torch calls a tensor contiguous whatever the
    strides of its size-1 dims, or of every dim when it is empty)."""
    return t.is_contiguous() and t.numel() > 0 and _bytes_as_is(t)


def _bytes_as_is(t: torch.Tensor) -> bool:
    """For a contiguous, non-empty ``t``: no negative or conjugate bit, and a last stride of 1
    (0-dim: none)."""
    if t.is_neg() or (t.dtype in _COMPLEX and t.is_conj()):
        return False
    strides = t.stride()          # stride() then [-1]: half the cost of stride(-1)
    return not strides or strides[-1] == 1


def contiguous_input(t: torch.Tensor) -> torch.Tensor:
    """The bytes a transport should send for ``t``: ``t`` itself when :func:`plain`, else a dense
    copy of what it reads as (conjugate/negative bits resolved by the copy)."""
    if plain(t):
        return t
    with torch.no_grad():       # a staging copy, not part of the user's graph
        return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def reprove(ts: list[Any], op: str) -> None:
    """Bounds again, right before a queued op runs (a storage may have been resized meanwhile)."""
    for i, t in enumerate(ts):
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            if (t.data_ptr() == 0
                    or (t.storage_offset() + _extent(t)) * t.element_size() > st.nbytes()):
                raise fail(ValueError, op, f"tensor {i}", "expected its storage to stay allocated "
                           f"until the op ran, but {_describe(t)} was resized to {st.nbytes()} "
                           "bytes (wait for the Work before freeing or resizing its tensors)")


class Staged:
    """A contiguous stand-in for a user tensor; ``finish()`` copies results back into a strided
    (or conjugate) view."""

    __slots__ = ("buf", "user")

    def __init__(self, user: torch.Tensor) -> None:
        self.user = user
        self.buf = contiguous_input(user)

    def finish(self) -> None:
        if self.buf is not self.user:
            self.user.copy_(self.buf)


# -- reduce ops, ranks and other scalars ---------------------------------------------------
def _named(e: Exception, op: str, arg: str) -> Exception:
    return type(e)(f"{_who()}{op}: {arg}: {str(e).removeprefix(f'{op}: ')}")


def reduce_op(op: Any, name: str) -> tuple[RedOpType, float | None]:
    """``resolve_op`` with the refusal naming the rank and the ``op`` argument."""
    if type(op) is RedOpType and op != _PREMUL_SUM:     # the common case, without a call
        return op, None
    try:
        return resolve_op(op, name)
    except (TypeError, ValueError) as e:
        raise _named(e, name, "op") from None


def op_dtype(red: RedOpType, dtype: torch.dtype, name: str) -> None:
    """``check_op_dtype`` (an operator that makes no sense on ``dtype``),
    naming rank and argument."""
    try:
        check_op_dtype(red, dtype, name)
    except (TypeError, ValueError) as e:
        raise _named(e, name, "op") from None



def _int(x: Any) -> int | None:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        return None
    return int(x)


def root(r: Any, size: int, op: str, arg: str) -> int:
    """A group rank in ``[0, size)`` (bools and floats refused)."""
    v = _int(r)
    if v is None or not 0 <= v < size:
        raise fail(ValueError, op, arg, f"expected a group rank in [0, {size}), got {r!r}")
    return v


def peer(pg: ProcessGroup, global_rank: Any, group_rank: Any, op: str, arg: str) -> int:
    """Group rank of a root/peer given either torch's global ``src``/``dst`` or
    ``group_src``/``group_dst``."""
    if global_rank is not None and group_rank is not None:
        raise fail(ValueError, op, arg, f"expected either {arg} or group_{arg}, got both")
    if group_rank is not None:
        return root(group_rank, pg.size(), op, f"group_{arg}")
    if global_rank is None:
        if op not in ("broadcast", "reduce", "gather", "scatter"):
            raise fail(ValueError, op, arg, "expected a rank, got None")
        global_rank = 0
    v = _int(global_rank)
    ranks = pg.ranks
    if v is None or v not in ranks:
        raise fail(ValueError, op, arg, "expected a global rank of the group "
                   f"{ranks}, got {global_rank!r}")
    return ranks.index(v)


def tag(t: Any, op: str) -> int:
    v = _int(t)
    if v is None or not -(1 << 31) <= v < 1 << 31:
        raise fail(ValueError, op, "tag", f"expected a 32-bit integer, got {t!r}")
    return v


def split_sizes(sizes: Any, n: int, rows: int, op: str, arg: str) -> list[int]:
    """``n`` non-negative integers summing to ``rows`` (dim 0); even splits when not given."""
    if sizes is None or (isinstance(sizes, (list, tuple)) and not sizes):
        if rows % n:
            raise fail(ValueError, op, arg, f"not given, so dim 0 ({rows}) must divide evenly by "
                       f"world size {n}")
        return [rows // n] * n
    given = list(sizes) if isinstance(sizes, (list, tuple)) else []
    vals = [v for v in map(_int, given) if v is not None and v >= 0]
    if len(given) != n or len(vals) != n or sum(vals) != rows:
        raise fail(ValueError, op, arg, f"expected {n} non-negative integers summing to dim 0 "
                   f"({rows}), got {sizes!r}")
    return vals
