"""``--from-env``: read the job's shape from Slurm (``srun``) or MPI (``mpirun``) variables.

Pure functions of an environment mapping, unit-tested with fake environments.  Two shapes:

- *one task per node* (``srun --ntasks-per-node=1 ringlet-run --from-env
slurm --nproc-per-node K``):
  each task is a node of the launch; ``SLURM_NODEID`` is its node rank.
- *one task per rank* (``srun -n 8 ringlet-run --from-env slurm ...``, or ``mpirun -n 8 ...``):
  each task is a "node" of one worker; its node rank is the task's rank, and the worker's
  ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` come from the scheduler (``SLURM_LOCALID``,
  ``OMPI_COMM_WORLD_LOCAL_RANK``, ...), so per-host device placement still works.

The master address is the first host of Slurm's node list (``node[01-04]`` -> ``node01``); MPI has
no node list, so ``--master-addr`` or ``MASTER_ADDR`` is needed there.  The port is
``--master-port``, else ``MASTER_PORT``, else (Slurm) ``20000 + SLURM_JOB_ID % 20000``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Placement", "detect", "expand_nodelist"]

KINDS = ("auto", "slurm", "mpi")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """What the scheduler says about this process's place in the job."""

    source: str                       # e.g. "slurm, one task per rank"
    nnodes: int
    node_rank: int
    nproc_per_node: int
    local_rank_base: int = 0          # LOCAL_RANK of this node's first worker
    local_world_size: int = 0         # LOCAL_WORLD_SIZE (0: nproc_per_node)
    master_addr: str | None = None
    master_port: int | None = None


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list: ``a[01-03,7],b`` -> ``[a01, a02, a03, a7, b]``.

    Raises ``ValueError`` for an unbalanced bracket or a bad range.
    """
    items, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"expected a Slurm node list such as node[01-04],gpu7, got {text!r}")
        cur += ch
    if depth:
        raise ValueError(f"expected a Slurm node list such as node[01-04],gpu7, got {text!r}")
    items.append(cur)
    hosts: list[str] = []
    for item in filter(None, items):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
        if m is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"expected numeric ranges in the Slurm node list, got {item!r}")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def _tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"expected SLURM_TASKS_PER_NODE like 2(x3),1, got {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"--from-env: expected {name} in the environment (is this process started "
                         "by srun/mpirun?), but it is not set")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"--from-env: {name}: expected an integer, got {raw!r}") from None


def _slurm(env: Mapping[str, str], nproc: int) -> Placement:
    ntasks, procid = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID")
    nnodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST"))
    master = expand_nodelist(nodelist)[0] if nodelist else None
    job = env.get("SLURM_JOB_ID")
    port = 20000 + int(job) % 20000 if job and job.isdigit() else None
    if ntasks == nnodes:
        return Placement(source="slurm, one task per node", nnodes=nnodes,
                         node_rank=_int(env, "SLURM_NODEID"), nproc_per_node=nproc,
                         master_addr=master, master_port=port)
    if nproc != 1:
        raise ValueError(f"--from-env slurm: {ntasks} tasks on {nnodes} nodes is one task per "
                         f"rank, so expected --nproc-per-node 1, got {nproc}")
    node = int(env.get("SLURM_NODEID", "0"))
    per_node = env.get("SLURM_TASKS_PER_NODE")
    local_size = (_tasks_per_node(per_node)[node] if per_node
                  else int(env.get("SLURM_NTASKS_PER_NODE", "1")))
    return Placement(source="slurm, one task per rank", nnodes=ntasks, node_rank=procid,
                     nproc_per_node=1, local_rank_base=_int(env, "SLURM_LOCALID"),
                     local_world_size=local_size,
                     master_addr=master, master_port=port)


def _mpi(env: Mapping[str, str], nproc: int) -> Placement:
    if "OMPI_COMM_WORLD_RANK" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:   # MPICH / Intel MPI (Hydra)
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if nproc != 1:
        raise ValueError("--from-env mpi: mpirun starts one task per rank, so expected "
                         f"--nproc-per-node 1, got {nproc}")
    rank, size = _int(env, names[0]), _int(env, names[1])
    return Placement(source="mpi, one task per rank", nnodes=size, node_rank=rank, nproc_per_node=1,
                     local_rank_base=int(env.get(names[2], "0")),
                     local_world_size=int(env.get(names[3], "1")))


def detect(kind: str, env: Mapping[str, str], nproc_per_node: int) -> Placement:
    """The :class:`Placement` for ``--from-env kind`` (``auto``, ``slurm`` or ``mpi``).

    Raises ``ValueError`` worded "expected ..., got ..." when the variables are missing or odd.

    Example::

        >>> p = detect("slurm", {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NNODES": "2",
        ...                      "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}, 4)
        >>> (p.nnodes, p.node_rank, p.nproc_per_node, p.master_addr)
        (2, 1, 4, 'n1')
    """
    if kind not in KINDS:
        raise ValueError(f"expected --from-env in {KINDS}, got {kind!r}")
    if kind == "auto":
        if "SLURM_PROCID" in env:
            kind = "slurm"
        elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
            kind = "mpi"
        else:
            raise ValueError("expected a Slurm (SLURM_PROCID) or MPI (OMPI_COMM_WORLD_RANK, "
                             "PMI_RANK) environment for --from-env auto, got neither")
    return _slurm(env, nproc_per_node) if kind == "slurm" else _mpi(env, nproc_per_node)
