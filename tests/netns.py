"""Simulated hosts for tests: network namespaces on one bridge
(docs/reliability.md#simulated-hosts).

``SimNet(k)`` builds ``k`` hosts ``10.77.0.1 .. 10.77.0.k`` (namespaces ``rt_<tag>_h0..``), each
with a veth pair whose other end is a port of a bridge in the "switch" namespace ``rt_<tag>_sw``.
The tag is random per fixture, so two test sessions on one machine never share a namespace or an
interface name; everything is prefixed ``rt`` so that a sweep can remove leftovers.  The network
is always torn down (``close``), and every process started in it is killed and reaped.

``require_netns()`` skips a test (``pytest.skip``) with the reason when namespaces cannot be made
(not root, no ``ip``); ``netns_problem()`` gives that reason to non-test callers (the benchmark).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Self

__all__ = ["SimNet", "netns_problem", "require_netns"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def netns_problem() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns add)"
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2's `ip`"
    probe = f"rt_probe_{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """Skip the calling test (with the reason) unless network namespaces can be created here."""
    import pytest

    problem = netns_problem()
    if problem:
        pytest.skip(problem)


class SimNet:
    """``k`` simulated hosts on one switch.  Use as a context manager."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.tag = secrets.token_hex(2)
        self.sw = f"rt_{self.tag}_sw"
        self.hosts = [f"rt_{self.tag}_h{i}" for i in range(k)]
        self.addrs = [f"10.77.0.{i + 1}" for i in range(k)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def veth(self, i: int) -> str:
        """Host ``i``'s interface (inside its namespace)."""
        return f"rt{self.tag}v{i}"

    def port(self, i: int) -> str:
        """Host ``i``'s switch port (inside the switch namespace)."""
        return f"rt{self.tag}p{i}"

    def __enter__(self) -> Self:
        try:
            _ip("netns", "add", self.sw)
            _ip("-n", self.sw, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.sw, "link", "set", "br0", "up")
            for i, ns in enumerate(self.hosts):
                _ip("netns", "add", ns)
                _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", self.port(i))
                _ip("link", "set", self.veth(i), "netns", ns)
                _ip("link", "set", self.port(i), "netns", self.sw)
                _ip("-n", self.sw, "link", "set", self.port(i), "master", "br0")
                _ip("-n", self.sw, "link", "set", self.port(i), "up")
                _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", self.veth(i))
                _ip("-n", ns, "link", "set", self.veth(i), "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cut(self, i: int) -> None:
        """Take host ``i``'s switch port down: no RST, no FIN, packets just vanish."""
        _ip("-n", self.sw, "link", "set", self.port(i), "down")

    def shape(self, i: int, rate: str) -> None:
        """Limit host ``i``'s link to ``rate`` (e.g. ``1gbit``) both ways, with ``tc tbf``
        (netem is not available here): a network slower than memory, as between real hosts."""
        burst = "512kb"   # >= rate / HZ for rates up to ~4 Gbit/s
        for ns, dev in ((self.hosts[i], self.veth(i)), (self.sw, self.port(i))):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                            "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms"],
                           check=True, capture_output=True, text=True, timeout=20)

    def start(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None,
              log: str | None = None) -> subprocess.Popen[bytes]:
        """Run ``argv`` on host ``i`` (``ip netns exec``); output goes to ``log``."""
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        if log:
            out.close()   # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def wait_all(self, timeout: float) -> list[int | None]:
        """Wait for every process (bounded); returns their exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"netns: process {p.pid} survived SIGKILL", file=sys.stderr)

    def close(self) -> None:
        """Kill every process started here, then delete every namespace (links go with them)."""
        self.kill_all()
        for ns in [*self.hosts, self.sw]:
            _ip("netns", "del", ns, check=False)
