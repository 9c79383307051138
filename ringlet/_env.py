"""Every ``RINGLET_*`` environment variable is read here, and documented here once.

| variable | meaning | default |
|---|---|---|
| ``RINGLET_TIMEOUT`` | default deadline (seconds) of every blocking call | 300 |
| ``RINGLET_DEBUG`` | ``OFF``, ``INFO`` or ``DETAIL`` (cross-rank fingerprint checks with call
  sites) | OFF |
| ``RINGLET_STORE_TOKEN`` | run token a TCPStore client must present | unset |
| ``RINGLET_STORE_TOKEN_FILE`` | file (mode 0600) holding the run token; the launcher sets it
  | unset |
| ``RINGLET_RUNTIME_DIR`` | private (0700) directory of this user's host secrets (stores started
  without a token) | ``/tmp/ringlet-<uid>`` |
| ``RINGLET_SHM_SLOT_BYTES`` | bytes of one shared-memory slot (chunk size) per rank | 1 MiB |
| ``RINGLET_SHM_BUFFER_BYTES`` | address space reserved per rank for communication buffers in a
  group's shared memory (``comm_buffer``; committed only as buffers are allocated); 0: none
  | 16 GiB |
| ``RINGLET_SHM_PEER_READ_BYTES`` | an ordinary (non-``comm_buffer``) all_reduce of at least this
  many bytes, up to 16 MiB, reads the peers' memory directly (``process_vm_readv``) where the
  kernel allows it; 0: never | 4 MiB |
| ``RINGLET_SAFE_OBJECTS`` | ``1`` on every rank: object collectives build only plain data and
  tensors (``torch.load(weights_only=True)``; docs/security.md) | 0 |
| ``RINGLET_HEARTBEAT_TIMEOUT`` | seconds without progress after which ``ringlet-run`` kills a
  worker (0: off); ``--heartbeat-timeout`` | 0 |
| ``RINGLET_AGENT_STORE`` | ``1``: the launcher hosts the store; every rank connects as a client
  | 0 |
| ``RINGLET_CHECKS`` | ``0``: skip the per-collective fingerprint comparison (for measuring its cost
  only) | 1 |
| ``RINGLET_STRAGGLER_REPORT`` | seconds between per-rank straggler lines logged by the watchdog (0:
  off) | 0 |
| ``RINGLET_IFNAME`` | network interface the tcp transport listens on (default: the one that reaches
  the store) | unset |
| ``RINGLET_TCP_CHUNK_BYTES`` | pipelining chunk of the tcp transport's large-message algorithms
  | 1 MiB |
| ``RINGLET_TCP_OVERLAP`` | ``1``: the tcp transport's reader thread receives a large
  collective's frames while the calling thread sends and reduces (pays only with a spare core
  per rank) | 0 |
| ``RINGLET_TORCH_TRANSPORT`` | transport under torch's backend ``"ringlet"``
  (``init_process_group("ringlet")``): ``auto``, ``shm`` or ``tcp`` | auto |
| ``RINGLET_TORCH_DEFAULT`` | ``1``: a torch program launched by ``ringlet-run`` gets
  ``"ringlet"`` as torch's default CPU backend (``init_process_group()`` naming none);
  ``ringlet-run --torch-backend`` sets it | 0 |
| ``RINGLET_NO_FUTEX`` | ``1``: shared-memory waits back off on timers instead of sleeping on a
  futex (for tests and comparisons) | 0 |
| ``RINGLET_FAULT`` | test-only fault injection, e.g. ``rank=1;at=collective:seq=5;do=sigkill``
  | unset |
| ``RINGLET_CKPT_FAULT`` | test-only: ``rank=1;after_bytes=N;do=sigkill`` kills that rank N bytes
  into writing its checkpoint shard | unset |
| ``RINGLET_FT_FAULT`` | test-only: ``heal-source:R`` kills replica R (first incarnation) as it
  starts sending its state to a rejoining replica (``ringlet.ft``) | unset |

torch's variables that users already set are honoured too (a ``RINGLET_*`` one wins):

| variable | meaning in ringlet | default |
|---|---|---|
| ``TORCH_DISTRIBUTED_DEBUG`` | same as ``RINGLET_DEBUG`` (``set_debug_level_from_env()`` reads it
  again) | OFF |
| ``GLOO_SOCKET_IFNAME`` | same as ``RINGLET_IFNAME`` (the first of a comma-separated list)
  | unset |
| ``TORCH_CPP_LOG_LEVEL`` | level of ringlet's log (logger ``ringlet``): ``INFO``, ``WARNING``,
  ``ERROR``, ``FATAL`` | unset: quiet |
| ``TORCH_SHOW_CPP_STACKTRACES`` | ``1``: hang reports carry every rank's full Python stack, not
  only the innermost user frame | 0 |
| ``TORCHELASTIC_RUN_ID``, ``LOCAL_RANK`` | read by ``is_torchelastic_launched()`` and
  ``get_node_local_rank()`` | set by ringlet-run |

Set by ``ringlet-run`` for its workers, not by hand: ``RINGLET_RUN_DIR`` (the run's private
directory), ``RINGLET_GENERATION`` (the restart count), ``RINGLET_LAUNCHER_PID``,
``RINGLET_HEARTBEAT_FILE`` (the worker's heartbeat counter), ``RINGLET_CONSOLE_TTY`` (the
worker's output ends on a terminal), ``RINGLET_RESTART_POLICY``, ``RINGLET_REPLICA_SIZE`` and
``RINGLET_REPLICA_RESTART`` (``--restart-policy replica``: processes per replica and how often
this replica was restarted; read by ``ringlet.ft``), besides torchrun's ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and the rest.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SLOT_BYTES = 1 << 20
DEFAULT_PEER_READ_BYTES = 4 << 20
DEFAULT_BUFFER_BYTES = 16 << 30
DEFAULT_TCP_CHUNK_BYTES = 1 << 20


def timeout_seconds() -> float:
    """Default deadline of blocking calls, from ``RINGLET_TIMEOUT`` (seconds)."""
    raw = os.environ.get("RINGLET_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"RINGLET_TIMEOUT: expected a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"RINGLET_TIMEOUT: expected a positive number of seconds, got {raw!r}")
    return value


def default_timeout() -> timedelta:
    return timedelta(seconds=timeout_seconds())


def debug_level() -> str:
    level = os.environ.get("RINGLET_DEBUG", os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF"))
    level = level.strip().upper() or "OFF"
    if level not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"RINGLET_DEBUG: expected OFF, INFO or DETAIL, got {level!r}")
    return level


def store_token() -> bytes | None:
    """The run token, from ``RINGLET_STORE_TOKEN_FILE`` (preferred) or ``RINGLET_STORE_TOKEN``."""
    path = os.environ.get("RINGLET_STORE_TOKEN_FILE")
    if path:
        with open(path, "rb") as f:
            return f.read().strip() or None
    raw = os.environ.get("RINGLET_STORE_TOKEN")
    return raw.encode() if raw else None


def runtime_dir() -> str | None:
    """``RINGLET_RUNTIME_DIR``: where host secrets live (None: ``/tmp/ringlet-<uid>``)."""
    return os.environ.get("RINGLET_RUNTIME_DIR") or None


def _byte_count(name: str, default: int, minimum: int) -> int:
    """The byte count in variable ``name`` (``default`` when unset or empty), >= ``minimum``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer number of bytes, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name}: expected bytes >= {minimum}, got {value}")
    return value


def shm_slot_bytes() -> int:
    """``RINGLET_SHM_SLOT_BYTES``: bytes of one shared-memory slot per rank (default 1 MiB)."""
    return _byte_count("RINGLET_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES, 4096)


def shm_buffer_bytes() -> int:
    """``RINGLET_SHM_BUFFER_BYTES``: per-rank reservation of a group's buffer heap (0: none)."""
    return _byte_count("RINGLET_SHM_BUFFER_BYTES", DEFAULT_BUFFER_BYTES, 0)


def shm_peer_read_bytes() -> int:
    """``RINGLET_SHM_PEER_READ_BYTES``: an ordinary all_reduce of at least this many bytes (and at
    most 16 MiB) reads the peers' memory directly where the kernel allows it (0: never)."""
    return _byte_count("RINGLET_SHM_PEER_READ_BYTES", DEFAULT_PEER_READ_BYTES, 0)


def safe_objects() -> bool:
    return os.environ.get("RINGLET_SAFE_OBJECTS", "0") not in ("", "0", "false", "False")


def heartbeat_timeout() -> float:
    """``RINGLET_HEARTBEAT_TIMEOUT``: the launcher's default ``--heartbeat-timeout`` (0: off)."""
    raw = os.environ.get("RINGLET_HEARTBEAT_TIMEOUT", "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"RINGLET_HEARTBEAT_TIMEOUT: expected seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"RINGLET_HEARTBEAT_TIMEOUT: expected seconds >= 0, got {raw!r}")
    return value


def agent_store() -> bool:
    return os.environ.get("RINGLET_AGENT_STORE", "0") not in ("", "0")


def no_futex() -> bool:
    """``RINGLET_NO_FUTEX=1``: arena waits never sleep on a futex (the timer back-off instead)."""
    return os.environ.get("RINGLET_NO_FUTEX") == "1"


def fault_spec() -> str | None:
    return os.environ.get("RINGLET_FAULT") or None


def ckpt_fault_spec() -> str | None:
    return os.environ.get("RINGLET_CKPT_FAULT") or None


def env_rank() -> int | None:
    """This process's rank from torchrun's ``RANK`` (None when unset); a store client claims it."""
    raw = os.environ.get("RANK")
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"RANK: expected an integer, got {raw!r}") from None


def run_prefix() -> str:
    """Store key prefix that separates runs and restart generations sharing one store."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"{run}/{gen}/" if run or gen else ""


def fingerprint_checks() -> bool:
    """Whether transports compare every peer's collective fingerprint (default: yes)."""
    return os.environ.get("RINGLET_CHECKS", "1") not in ("0", "false", "False", "off")


def straggler_report_period() -> float:
    raw = os.environ.get("RINGLET_STRAGGLER_REPORT", "0")
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise ValueError(f"RINGLET_STRAGGLER_REPORT: expected seconds, got {raw!r}") from None


def ifname() -> str | None:
    """``RINGLET_IFNAME`` (else gloo's ``GLOO_SOCKET_IFNAME``, its first entry): the interface whose
    IPv4 address the tcp transport binds (None: automatic)."""
    raw = os.environ.get("RINGLET_IFNAME", "").strip()
    if not raw:
        raw = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    return raw or None


_LOG_LEVELS = {"INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
               "FATAL": logging.CRITICAL, "0": logging.INFO, "1": logging.WARNING,
               "2": logging.ERROR, "3": logging.CRITICAL}


def log_level() -> int | None:
    """``TORCH_CPP_LOG_LEVEL`` as a ``logging`` level for ringlet's log (None: unset)."""
    raw = os.environ.get("TORCH_CPP_LOG_LEVEL", "").strip().upper()
    if not raw:
        return None
    if raw not in _LOG_LEVELS:
        raise ValueError("TORCH_CPP_LOG_LEVEL: expected INFO, WARNING, ERROR or FATAL, got "
                         f"{raw!r}")
    return _LOG_LEVELS[raw]


def show_stacktraces() -> bool:
    """``TORCH_SHOW_CPP_STACKTRACES=1``: errors that report peers (hang reports) carry full
    stacks."""
    raw = os.environ.get("TORCH_SHOW_CPP_STACKTRACES", "0").strip()
    return raw not in ("", "0", "false", "False")


def tcp_chunk_bytes() -> int:
    """``RINGLET_TCP_CHUNK_BYTES``: bytes per pipelined frame of the tcp transport
    (default 1 MiB)."""
    return _byte_count("RINGLET_TCP_CHUNK_BYTES", DEFAULT_TCP_CHUNK_BYTES, 4096)


def tcp_overlap() -> bool:
    """``RINGLET_TCP_OVERLAP=1``: a tcp collective's frames are received by the transport's reader
    thread while the calling thread sends and reduces (default: the calling thread does all)."""
    raw = os.environ.get("RINGLET_TCP_OVERLAP", "0").strip()
    if raw not in ("0", "1", ""):
        raise ValueError(f"RINGLET_TCP_OVERLAP: expected 0 or 1, got {raw!r}")
    return raw == "1"


def torch_transport() -> str:
    """``RINGLET_TORCH_TRANSPORT``: the ringlet transport under torch's backend ``"ringlet"``
    (default ``auto``)."""
    return os.environ.get("RINGLET_TORCH_TRANSPORT", "").strip() or "auto"


def torch_default() -> bool:
    """``RINGLET_TORCH_DEFAULT=1``: make ``"ringlet"`` torch's default CPU backend in this
    process (the worker bootstrap of ``ringlet-run --torch-backend`` reads it)."""
    raw = os.environ.get("RINGLET_TORCH_DEFAULT", "0").strip()
    if raw not in ("0", "1", ""):
        raise ValueError(f"RINGLET_TORCH_DEFAULT: expected 0 or 1, got {raw!r}")
    return raw == "1"


def replica_size() -> int:
    """Processes per replica (``RINGLET_REPLICA_SIZE``, set by ``ringlet-run --replica-size``)."""
    return int(os.environ.get("RINGLET_REPLICA_SIZE", "1"))


def replica_restart() -> int:
    """How often this replica was restarted (``RINGLET_REPLICA_RESTART``; 0 when never)."""
    return int(os.environ.get("RINGLET_REPLICA_RESTART", "0"))


def replica_restarts_only() -> bool:
    """Whether ``ringlet-run`` restarts single replicas (``--restart-policy replica``)."""
    return os.environ.get("RINGLET_RESTART_POLICY") == "replica"


def ft_fault_spec() -> str | None:
    """Test-only fault injection of ``ringlet.ft`` (``RINGLET_FT_FAULT``)."""
    return os.environ.get("RINGLET_FT_FAULT") or None
