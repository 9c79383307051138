"""Groups outside the default world: built on a store of their own, by any set of processes.

The default world (``init_process_group``) and the groups made from it (``new_group``) need every
rank of the world.  A fault-tolerant job (``ringlet.ft``) rebuilds the group of its live replicas
after a failure, among processes that never shared a world, with a store prefix per
reconfiguration; :func:`standalone_group` is that constructor.  The group it returns is an
ordinary :class:`~ringlet.c10d.group.ProcessGroup` (every collective, ``group_src``/``group_dst``
p2p, timeouts, ``abort``) whose global ranks are its group ranks ``0..size-1``.
"""

from __future__ import annotations

from typing import Any

from ringlet.c10d.group import ProcessGroup
from ringlet.c10d.rendezvous import check_ranks, rendezvous
from ringlet.transport import selection

__all__ = ["standalone_group"]


def standalone_group(store: Any, rank: int, size: int, *, backend: str = "auto",
                     timeout: float = 300.0, name: str = "standalone") -> ProcessGroup:
    """Rendezvous ``size`` processes on ``store`` (prefixed for this group alone), open ``backend``.

    Args:
        store: a store every member reaches, with a prefix no other group uses.
        rank: this process's position in the group, ``0 <= rank < size``.
        size: the number of members.
        backend: ringlet's transport name (``auto``, ``shm``, ``tcp``; see ``init_process_group``).
        timeout: seconds for the rendezvous, and for every collective of the group.
        name: the group's name in reprs, errors and hang reports.

    Raises:
        ValueError: bad ``rank``/``size``, or members that disagree on the backend or version.
        DistStoreError: members that did not arrive within ``timeout``, named.

    Example::

        pg = standalone_group(PrefixStore("replicas/gen3", store), rank=1, size=3)
        all_reduce(t, group=pg)
    """
    check_ranks(rank, size)
    spec = selection.parse_backend(backend)
    hosts = rendezvous(store, rank, size, spec, timeout)
    transport, resolved = selection.open_transport(spec, store, rank, hosts, timeout, name)
    return ProcessGroup(name, list(range(size)), rank, transport, timeout, backend, name,
                        transport_name=resolved)
