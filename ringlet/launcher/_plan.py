"""Pure launch planning: command line -> :class:`LaunchConfig` -> per-worker environments.

Nothing here starts a process, opens a socket or reads the clock, so every rule of the
launcher's interface (flag spellings, defaults, validation, the environment each worker
gets) is unit-tested without processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringlet import _env
from ringlet._heartbeat import ENV as HEARTBEAT_ENV
from ringlet.launcher._logs import parse_ranks_filter, parse_std
from ringlet.launcher._schedulers import KINDS, detect

__all__ = [
    "LaunchConfig",
    "build_parser",
    "error_file",
    "parse_args",
    "parse_nproc",
    "worker_command",
    "worker_env",
]

PROG = "ringlet-run"
LEGACY_PROG = "python -m ringlet.distributed.launch"
# Workers run the bootstrap by path: importing it as a module would import the ringlet package,
# hence torch, before the user's code (see _worker's docstring).
WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """One launch, as the command line asked for it (validated on construction)."""

    entrypoint: str  # script path, module name (``module``) or command (``no_python``)
    args: tuple[str, ...] = ()  # arguments passed through to the entrypoint
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the store binds a free port and the workers get the real one
    standalone: bool = False
    max_restarts: int = 0
    rdzv_id: str | None = None
    monitor_interval: float = 0.1  # seconds between polls of the workers
    grace_period: float = 5.0  # seconds between SIGTERM and SIGKILL at teardown
    module: bool = False
    no_python: bool = False
    token_file: str | None = None  # --rdzv-token-file: the run token shared by every node
    rdzv_timeout: float = 300.0  # seconds for every node to reach node 0 (and for node 0 to answer)
    local_rank_base: int = 0  # LOCAL_RANK of local worker 0 (one-task-per-rank schedulers)
    local_world_size: int = 0  # LOCAL_WORLD_SIZE; 0 means nproc_per_node
    scheduler: str | None = None  # where --from-env found the job's shape, for messages
    log_dir: str | None = None  # --log-dir: per-rank log files, one folder per attempt (_logs)
    redirects: str = "0"  # -r: streams that go to the log files only ("3", "0:1,1:2")
    tee: str = "0"  # -t: streams that go to the log files and the console
    local_ranks_filter: str = ""  # console shows only these local ranks ("0,1"); "" = all
    heartbeat_timeout: float = 0.0  # kill a worker silent this long (s); 0 = off (_watch)
    local_rank_arg: str | None = None  # legacy launch: "--local-rank" passed as "--local-rank=N"
    torch_backend: bool = False  # --torch-backend: torch programs get "ringlet" as CPU default
    restart_policy: str = "job"  # --restart-policy: "job" restarts everyone, "replica" the failed
    replica_size: int = 1  # --replica-size: workers per replica (restarted together)

    def __post_init__(self) -> None:
        _check(bool(self.entrypoint), "a training script, module or command", repr(self.entrypoint))
        _check(self.nproc_per_node >= 1, "--nproc-per-node >= 1", self.nproc_per_node)
        _check(self.nnodes >= 1, "--nnodes >= 1", self.nnodes)
        _check(
            0 <= self.node_rank < self.nnodes,
            f"0 <= --node-rank < --nnodes ({self.nnodes})",
            self.node_rank,
        )
        _check(0 <= self.master_port <= 65535, "--master-port in [0, 65535]", self.master_port)
        _check(bool(self.master_addr), "a non-empty --master-addr", repr(self.master_addr))
        _check(self.max_restarts >= 0, "--max-restarts >= 0", self.max_restarts)
        _check(self.monitor_interval > 0, "--monitor-interval > 0", self.monitor_interval)
        _check(self.grace_period >= 0, "--grace-period >= 0", self.grace_period)
        _check(
            not (self.module and self.no_python),
            "at most one of -m/--module and --no-python",
            "both",
        )
        _check(
            not (self.standalone and self.nnodes > 1),
            "--nnodes 1 with --standalone",
            self.nnodes,
        )
        _check(self.rdzv_timeout > 0, "--rdzv-timeout > 0", self.rdzv_timeout)
        _check(self.heartbeat_timeout >= 0, "--heartbeat-timeout >= 0", self.heartbeat_timeout)
        _check(self.restart_policy in ("job", "replica"), "--restart-policy job or replica",
               repr(self.restart_policy))
        _check(self.replica_size >= 1 and self.local_size % self.replica_size == 0,
               f"--replica-size dividing the workers per node ({self.local_size})",
               self.replica_size)
        _check(self.restart_policy == "job" or self.nnodes == 1,
               "--nnodes 1 with --restart-policy replica (replica restarts run on one node)",
               self.nnodes)
        parse_std(self.redirects, "--redirects")
        parse_std(self.tee, "--tee")
        parse_ranks_filter(self.local_ranks_filter)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def check_reachable(self) -> None:
        """A node other than 0 must know node 0's port (node 0 alone may pick one: port 0)."""
        _check(
            self.node_rank == 0 or self.master_port != 0,
            f"--master-port (the port of node 0's store) for node rank {self.node_rank}",
            self.master_port,
        )

    @property
    def local_size(self) -> int:
        """Workers of this host (LOCAL_WORLD_SIZE); more than nproc_per_node under --from-env."""
        return self.local_world_size or self.nproc_per_node


def _check(ok: bool, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"expected {expected}, got {got}")


class _Parser(argparse.ArgumentParser):
    """Raises ``ValueError`` instead of exiting, so callers (and tests) decide what to do."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def parse_nproc(value: str, cpu_count: int | None = None) -> int:
    """``--nproc-per-node``: a positive integer, or ``cpu``/``auto`` for the CPU count."""
    text = value.strip().lower()
    if text in ("cpu", "auto"):
        return cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, 'cpu' or 'auto', got {value!r}"
        ) from None


def _nnodes(value: str) -> int:
    # torchrun accepts "N" or "MIN:MAX"; only a fixed size is meaningful here.
    lo, _, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or MIN:MAX, got {value!r}"
        ) from None
    if low != high:
        raise argparse.ArgumentTypeError(
            f"expected a fixed node count (elastic MIN:MAX is not supported), got {value!r}"
        )
    return high


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None


def build_parser(legacy_launch: bool = False) -> argparse.ArgumentParser:
    """The ``ringlet-run`` parser; torchrun's dash and underscore spellings are both accepted.

    ``legacy_launch`` adds ``torch.distributed.launch``'s ``--use-env``
    (``ringlet.launcher.launch``).
    """
    p = _Parser(prog=LEGACY_PROG if legacy_launch else PROG, allow_abbrev=False,
                description="Launch local worker processes.")
    if legacy_launch:
        p.add_argument("--use-env", "--use_env", action="store_true",
                       help="give the local rank in LOCAL_RANK only; without it the script also "
                            "gets --local-rank=N, as torch.distributed.launch did")
        p.add_argument("--local-rank-spelling", "--local_rank_spelling",
                       choices=("dash", "underscore"), default="dash",
                       help="pass --local-rank=N (torch >= 2.0, default) or --local_rank=N (older "
                            "scripts whose parser knows only that spelling)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=parse_nproc, default=1,
                   metavar="N", help="workers on this node: an integer, 'cpu' or 'auto'")
    p.add_argument("--nnodes", type=_nnodes, default=None, help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=_int, default=None,
                   help="this node's rank (default 0)")
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help="address the rendezvous store binds (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=_int, default=None,
                   help="port of the rendezvous store (default: a free one the store picks)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST[:PORT]",
                   help="same as --master-addr/--master-port, torchrun's spelling")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static",
                   help="accepted for torchrun compatibility; the launcher hosts the store")
    p.add_argument("--rdzv-id", "--rdzv_id", default=None,
                   help="run id given to workers as TORCHELASTIC_RUN_ID (default: random)")
    p.add_argument("--standalone", action="store_true",
                   help="single node, store on 127.0.0.1 at a free port")
    p.add_argument("--rdzv-token-file", "--rdzv_token_file", default=None, metavar="PATH",
                   help="file (mode 0600) holding the run token, the same on every node")
    p.add_argument("--rdzv-timeout", "--rdzv_timeout", type=_seconds, default=None,
                   help="seconds for all nodes to reach node 0 (default RINGLET_TIMEOUT or 300)")
    p.add_argument("--from-env", "--from_env", choices=KINDS, default=None,
                   help="take nnodes/node rank/master address from Slurm (srun) or MPI (mpirun)")
    p.add_argument("--max-restarts", "--max_restarts", type=_int, default=0,
                   help="restart the whole group this many times after a failure (default 0)")
    p.add_argument("--restart-policy", "--restart_policy", choices=("job", "replica"),
                   default="job",
                   help="job: a failure restarts every worker (default); replica: only the "
                        "failed worker's replica restarts, the others go on (ringlet.ft)")
    p.add_argument("--replica-size", "--replica_size", type=_int, default=1,
                   help="workers per replica (a fully_shard/TP group restarted together; "
                        "default 1)")
    p.add_argument("--monitor-interval", "--monitor_interval", type=_seconds, default=0.1,
                   help="seconds between the launcher's periodic checks (workers' exits and "
                        "signals wake it at once; default 0.1)")
    p.add_argument("--grace-period", "--grace_period", type=_seconds, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers")
    p.add_argument("--log-dir", "--log_dir", default=None, metavar="DIR",
                   help="write each worker's stdout/stderr to "
                        "DIR/<run id>/attempt_<n>/<local rank>/")
    p.add_argument("-r", "--redirects", default="0", metavar="SPEC",
                   help="send streams to the log files only: 1 stdout, 2 stderr, 3 both; for all "
                        "local ranks ('3') or per rank ('0:1,1:2')")
    p.add_argument("-t", "--tee", default="0", metavar="SPEC",
                   help="send streams to the log files and the console (same SPEC as --redirects)")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default="", metavar="RANKS",
                   help="show only these local ranks on the console, e.g. 0,1 (log files get all)")
    p.add_argument("--heartbeat-timeout", "--heartbeat_timeout", type=_seconds, default=None,
                   metavar="S",
                   help="kill a worker that shows no progress for S seconds and count it "
                                     "as a failure (default RINGLET_HEARTBEAT_TIMEOUT, 0 = off)")
    p.add_argument("--torch-backend", "--torch_backend", action="store_true",
                   help="for programs that call torch.distributed: torch's default CPU backend "
                        "becomes 'ringlet' and init_process_group() joins this launcher's store "
                        "(docs/torch_backend.md)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the entrypoint as a module, like python -m")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the entrypoint as a command, without the python interpreter")
    p.add_argument("training_script", help="script, module (-m) or command (--no-python)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _endpoint(text: str) -> tuple[str, int | None]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, None
    try:
        return host, int(port)
    except ValueError:
        raise ValueError(f"expected --rdzv-endpoint HOST[:PORT], got {text!r}") from None


def _legacy_local_rank(ns: argparse.Namespace) -> str | None:
    if not hasattr(ns, "use_env") or ns.use_env:
        return None
    if ns.no_python:
        raise ValueError("expected --use-env with --no-python (a command cannot parse "
                         "--local-rank), got --no-python alone")
    return "--local_rank" if ns.local_rank_spelling == "underscore" else "--local-rank"


def parse_args(argv: Sequence[str], env: Mapping[str, str] | None = None,
               legacy_launch: bool = False) -> LaunchConfig:
    """Parse a ``ringlet-run`` command line (without the program name).

    ``env`` (default ``os.environ``) is read only with ``--from-env`` and for ``MASTER_ADDR``/
    ``MASTER_PORT`` fallbacks in that mode.  Raises ``ValueError`` worded "expected …, got …"
    for bad values, and argparse's wording for unknown flags or a missing script.
    """
    ns = build_parser(legacy_launch).parse_args(list(argv))
    env = os.environ if env is None else env
    addr, port = ns.master_addr, ns.master_port
    if ns.rdzv_endpoint:
        ep_host, ep_port = _endpoint(ns.rdzv_endpoint)
        addr = addr or ep_host
        port = port if port is not None else ep_port
    if ns.standalone:
        addr, port = "127.0.0.1", 0
    sched: dict[str, object] = {}
    if ns.from_env:
        if ns.nnodes is not None or ns.node_rank is not None:
            raise ValueError("expected no --nnodes/--node-rank with --from-env (the scheduler "
                             f"gives them), got --nnodes {ns.nnodes} --node-rank {ns.node_rank}")
        place = detect(ns.from_env, env, ns.nproc_per_node)
        addr = addr or place.master_addr or env.get("MASTER_ADDR")
        if port is None:
            port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else place.master_port
        if not addr or port is None:
            raise ValueError("expected --master-addr and --master-port (or "
                             f"MASTER_ADDR/MASTER_PORT) for --from-env {ns.from_env} "
                             f"({place.source}), got {addr!r} and {port!r}")
        sched = {"nnodes": place.nnodes, "node_rank": place.node_rank,
                 "local_rank_base": place.local_rank_base,
                 "local_world_size": place.local_world_size, "scheduler": place.source,
                 "nproc_per_node": place.nproc_per_node}
    cfg: dict[str, object] = {
        "nnodes": ns.nnodes or 1, "node_rank": ns.node_rank or 0,
        "nproc_per_node": ns.nproc_per_node}
    cfg.update(sched)
    config = LaunchConfig(
        entrypoint=ns.training_script,
        args=tuple(ns.training_script_args),
        master_addr=addr or "127.0.0.1",
        master_port=port if port is not None else 0,
        standalone=ns.standalone,
        max_restarts=ns.max_restarts,
        rdzv_id=ns.rdzv_id,
        monitor_interval=ns.monitor_interval,
        grace_period=ns.grace_period,
        module=ns.module,
        no_python=ns.no_python,
        token_file=ns.rdzv_token_file,
        rdzv_timeout=ns.rdzv_timeout if ns.rdzv_timeout is not None else _env.timeout_seconds(),
        log_dir=ns.log_dir,
        redirects=ns.redirects,
        tee=ns.tee,
        local_ranks_filter=ns.local_ranks_filter,
        heartbeat_timeout=(ns.heartbeat_timeout if ns.heartbeat_timeout is not None
                           else _env.heartbeat_timeout()),
        local_rank_arg=_legacy_local_rank(ns),
        torch_backend=getattr(ns, "torch_backend", False),
        restart_policy=getattr(ns, "restart_policy", "job"),
        replica_size=getattr(ns, "replica_size", 1),
        **cfg,  # type: ignore[arg-type]
    )
    config.check_reachable()
    return config


def error_file(run_dir: str, restart_count: int, rank: int) -> str:
    """Where the worker of ``rank`` in generation ``restart_count`` writes its traceback."""
    return os.path.join(run_dir, f"error-gen{restart_count}-rank{rank}.json")


def worker_env(
    config: LaunchConfig,
    local_rank: int,
    restart_count: int,
    port: int,
    *,
    run_id: str,
    run_dir: str,
    token_file: str,
    launcher_pid: int | None = None,
    base_env: Mapping[str, str] | None = None,
    heartbeat_file: str | None = None,
) -> dict[str, str]:
    """The full environment of one worker: ``base_env`` plus torchrun's and ringlet's variables.

    ``port`` is the port the store really bound. ``OMP_NUM_THREADS=1`` is added when
    ``base_env`` lacks it and more than one worker shares the node.

    Example::

        >>> cfg = LaunchConfig(entrypoint="train.py", nproc_per_node=2)
        >>> env = worker_env(cfg, 1, 0, 29500, run_id="r", run_dir="/tmp/d",
        ...                  token_file="/tmp/d/token", base_env={})
        >>> env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]
        ('1', '2', '29500')
    """
    if not 0 <= local_rank < config.nproc_per_node:
        raise ValueError(
            f"expected 0 <= local_rank < {config.nproc_per_node}, got {local_rank}"
        )
    rank = config.global_rank(local_rank)
    env = dict(os.environ if base_env is None else base_env)
    if "OMP_NUM_THREADS" not in env and config.local_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.pop("RINGLET_STORE_TOKEN", None)  # workers read the token from their 0600 file only
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(config.local_rank_base + local_rank),
        "WORLD_SIZE": str(config.world_size),
        "LOCAL_WORLD_SIZE": str(config.local_size),
        "GROUP_RANK": str(config.node_rank),
        "GROUP_WORLD_SIZE": str(config.nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(config.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_ERROR_FILE": error_file(run_dir, restart_count, rank),
        "RINGLET_AGENT_STORE": "1",
        "RINGLET_STORE_TOKEN_FILE": token_file,
        "RINGLET_RUN_DIR": run_dir,
        "RINGLET_GENERATION": str(restart_count),
        "PYTHONUNBUFFERED": "1",
    })
    if config.torch_backend:
        env["RINGLET_TORCH_DEFAULT"] = "1"     # read by the worker bootstrap (_worker.py)
    if config.restart_policy == "replica" or config.replica_size > 1:    # read by ringlet.ft
        env["RINGLET_REPLICA_SIZE"] = str(config.replica_size)
        env["RINGLET_RESTART_POLICY"] = config.restart_policy
        env["RINGLET_REPLICA_RESTART"] = str(restart_count if config.restart_policy == "replica"
                                             else 0)
    if launcher_pid is not None:
        env["RINGLET_LAUNCHER_PID"] = str(launcher_pid)
    env.pop(HEARTBEAT_ENV, None)   # a worker's own workers must not beat for it by accident
    if heartbeat_file is not None:
        env[HEARTBEAT_ENV] = heartbeat_file
    return env


def worker_command(config: LaunchConfig, python: str | None = None,
                   local_rank: int | None = None) -> list[str]:
    """argv of a worker: the bootstrap (``WORKER_FILE``), then the user's entrypoint and arguments
    (plus ``--local-rank=N`` for ``python -m ringlet.distributed.launch`` without
    ``--use-env``)."""
    head = [python or sys.executable, WORKER_FILE]
    if config.module:
        head.append("-m")
    elif config.no_python:
        head.append("--no-python")
    tail = []
    if config.local_rank_arg is not None and local_rank is not None:
        tail.append(f"{config.local_rank_arg}={config.local_rank_base + local_rank}")
    return [*head, config.entrypoint, *tail, *config.args]   # where torch's launch puts it
