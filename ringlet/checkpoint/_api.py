"""``save``, ``load`` and ``async_save`` with torch.distributed.checkpoint's signatures."""

from __future__ import annotations

import concurrent.futures
import enum
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import world as _world
from ringlet.checkpoint._coord import Coordinator, StoreCoordinator, coordinator_for
from ringlet.checkpoint._load import load_into
from ringlet.checkpoint._metadata import Metadata
from ringlet.checkpoint._save import Item, Prepared, finish, prepare, write
from ringlet.checkpoint.filesystem import FileSystemReader, FileSystemWriter, resolve_location
from ringlet.checkpoint.stateful import resolve_stateful

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg

__all__ = ["AsyncCheckpointerType", "DefaultLoadPlanner", "DefaultSavePlanner", "async_save",
           "load", "save"]


class AsyncCheckpointerType(enum.Enum):
    """Where :func:`async_save` writes, torch's names (``state_dict_saver.AsyncCheckpointerType``).

    ringlet writes in a background thread for both: its writer spends its time in file
    I/O, which releases the GIL, so a separate process would only add a copy of the
    snapshot.  ``PROCESS`` is accepted so that scripts asking for it run unchanged.
    """

    THREAD = "thread"
    PROCESS = "process"


class DefaultSavePlanner:
    """torch's default save planner; ringlet's planning is fixed, so this only carries options
    (accepted for compatibility: ``flatten_state_dict``,
    ``flatten_sharded_tensors``, ``dedup_*``)."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None,
                 dedup_save_to_lowest_rank: bool = False,
                 enable_plan_caching: bool = False) -> None:
        self.flatten_state_dict = flatten_state_dict


class DefaultLoadPlanner:
    """torch's default load planner; ``allow_partial_load=True`` lets keys be missing from the
    checkpoint (they keep their current values)."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        self.allow_partial_load = bool(allow_partial_load)


def _coordinator(process_group: GroupArg, no_dist: bool, op: str) -> Coordinator:
    return Coordinator() if no_dist else coordinator_for(process_group, op)


def _check_planner(planner: Any, kind: type, op: str) -> None:
    if planner is not None and not isinstance(planner, kind):
        raise TypeError(f"{op}: planner: expected None or a {kind.__name__}, got "
                        f"{type(planner).__name__} (custom planners are not supported)")


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_writer: FileSystemWriter | None = None, planner: DefaultSavePlanner | None = None,
         process_group: GroupArg = None, no_dist: bool = False,
         use_collectives: bool = True) -> Metadata:
    """Save ``state_dict`` (a collective: every rank of ``process_group`` calls it; an
    ``async_save`` of this rank still in flight is waited for first).

    Each rank writes only the pieces it owns (a tensor replicated on several ranks is
    written once); rank 0 then publishes ``metadata.json`` atomically.  Tensors may be
    plain tensors, DTensors of any placement, or parameters of DDP / fully_shard / TP
    models; other leaves must be plain values (see docs/checkpoint.md).  Top-level
    :class:`~ringlet.checkpoint.stateful.Stateful` values are asked for their ``state_dict()``.

    Args:
        state_dict: nested dicts/lists of tensors and plain values.
        checkpoint_id: the checkpoint directory (or give ``storage_writer``).
        storage_writer: a :class:`FileSystemWriter` (directory and write options).
        planner: ``None`` or a :class:`DefaultSavePlanner`.
        process_group: the ranks taking part (default: the world; none initialised: one process).
        no_dist: save from this process alone.

    Returns:
        The committed checkpoint's :class:`~ringlet.checkpoint.Metadata` (on every rank).

    Raises:
        CheckpointException: on every rank, if any rank failed (nothing is committed; the
            checkpoint previously in the directory stays loadable).

    Example::

        dcp.save({"model": model.state_dict(), "step": step}, checkpoint_id=f"ckpt/step_{step}")
    """
    _check_planner(planner, DefaultSavePlanner, "save")
    writer = resolve_location("save", checkpoint_id, storage_writer, FileSystemWriter)
    coord = _coordinator(process_group, no_dist, "save")
    _wait_inflight()
    resolved, _ = resolve_stateful(state_dict)
    prep = prepare(resolved, writer, coord)
    return finish(prep, write(prep, coord.rank), coord)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_reader: FileSystemReader | None = None, planner: DefaultLoadPlanner | None = None,
         process_group: GroupArg = None, no_dist: bool = False) -> None:
    """Load a checkpoint into ``state_dict`` in place, in the sharding ``state_dict`` has now
    (a collective).  Any world size and any strategy may have saved it.

    Every key of ``state_dict`` must be in the checkpoint (unless
    ``planner=DefaultLoadPlanner(allow_partial_load=True)``); keys only the checkpoint has
    are reported with a warning.  Before anything is copied, every rank checks the files and
    the crc32 of every byte range it will read, and the ranks agree on the outcome.

    Raises:
        CheckpointException: on every rank when any rank finds a problem (missing keys,
            dtype/shape mismatch, a missing, truncated, corrupt or symlinked file), naming
            the file and tensor; the state dict is then untouched.

    Example::

        state = {"model": model.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id="ckpt/step_100")
        model.load_state_dict(state["model"]); step = state["step"]
    """
    _check_planner(planner, DefaultLoadPlanner, "load")
    reader = resolve_location("load", checkpoint_id, storage_reader, FileSystemReader)
    coord = _coordinator(process_group, no_dist, "load")
    strict = not (planner is not None and planner.allow_partial_load)
    load_into(state_dict, reader.path, coord, strict)


# -- async_save ------------------------------------------------------------------------------
_inflight: dict[int, concurrent.futures.Future[Metadata]] = {}
_inflight_lock = threading.Lock()


def _slot() -> int:
    """One save in flight per rank: keyed by the world (ranks may be threads in tests)."""
    w = _world.current_world(required=False)
    return id(w) if w is not None else 0


def _wait_inflight() -> None:
    """Saves of one rank never overlap: wait for this rank's async save still in flight, if any."""
    with _inflight_lock:
        previous = _inflight.pop(_slot(), None)
    if previous is not None:
        concurrent.futures.wait([previous])


def _snapshot(prep: Prepared) -> None:
    """Copy the pieces this rank writes, so later updates of the live tensors cannot leak in."""
    staged: list[Item] = []
    for key, box, dtype, get in prep.items:
        copy = get().detach().to("cpu", copy=True).contiguous()
        staged.append((key, box, dtype, _getter(copy)))
    prep.items = staged


def _getter(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _background_coordinator(coord: Coordinator, save_id: str) -> Coordinator:
    if coord.size == 1:
        return Coordinator()
    w = _world.current_world()
    if w is None:  # pragma: no cover - a group exists, so a world does
        raise AssertionError("no world")
    return StoreCoordinator(w.store, coord.rank, coord.size, f"ringlet/ckpt/{save_id}", w.timeout)


def _check_checkpointer_type(kind: Any) -> None:
    if kind is None or isinstance(kind, AsyncCheckpointerType):
        return
    try:
        AsyncCheckpointerType(kind)
    except ValueError:
        raise ValueError(f"async_save: async_checkpointer_type: expected an AsyncCheckpointerType "
                         f"('thread' or 'process'), got {kind!r}") from None


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
               storage_writer: FileSystemWriter | None = None,
               planner: DefaultSavePlanner | None = None, process_group: GroupArg = None,
               async_checkpointer_type: Any = None,
               async_stager: Any = None, no_dist: bool = False,
               use_collectives: bool = True) -> concurrent.futures.Future[Metadata]:
    """Like :func:`save`, but the writing and the commit happen in a background thread.

    The call itself plans the save with its peers and copies the pieces this rank will
    write (the snapshot: values as of the call, whatever training does next), then
    returns a ``concurrent.futures.Future`` whose ``result()`` is the committed
    :class:`Metadata` or raises :class:`CheckpointException`.  The background half talks
    to its peers through the rendezvous store only, never through the training's process
    groups.  At most one save is in flight per rank: a new call first waits for the
    previous one.  Wait for the future before ``destroy_process_group``.
    ``async_checkpointer_type`` (an :class:`AsyncCheckpointerType` or its value) is checked
    and accepted; both kinds write in a background thread.

    Example::

        fut = dcp.async_save(state, checkpoint_id=f"ckpt/step_{step}")
        ...                      # keep training
        fut.result()             # before the next save, or at the end
    """
    _check_planner(planner, DefaultSavePlanner, "async_save")
    _check_checkpointer_type(async_checkpointer_type)
    writer = resolve_location("async_save", checkpoint_id, storage_writer, FileSystemWriter)
    coord = _coordinator(process_group, no_dist, "async_save")
    _wait_inflight()
    resolved, _ = resolve_stateful(state_dict)
    prep = prepare(resolved, writer, coord)
    try:
        with torch.no_grad():
            _snapshot(prep)
        bg = _background_coordinator(coord, prep.save_id)
    except BaseException:
        prep.release()
        raise
    future: concurrent.futures.Future[Metadata] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(finish(prep, write(prep, coord.rank), bg, "async_save"))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    thread = threading.Thread(target=run, name=f"ringlet-async-save-{prep.save_id}")
    with _inflight_lock:
        _inflight[_slot()] = future
    thread.start()
    return future
