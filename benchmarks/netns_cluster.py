"""Test "hosts" on one machine: H network namespaces joined by veth pairs to a bridge that lives
in a namespace of its own, and ``torchrun`` run inside each of them.

Layout (names carry a prefix with this process's id, so that concurrent runs never collide and
stale namespaces of dead runs can be recognised and removed)::

    <prefix>-br : bridge "br0" with ports "p0" .. "p<H-1>"
    <prefix>-h<i> : "lo" and "eth0" = 10.213.77.<i+1>/24, the peer of port "p<i>"

Addresses are assigned only to interfaces inside these namespaces; nothing is created in the
namespace this process runs in, and all traffic stays on the bridge (rendezvous on host 0's
address). Every namespace (and with it every interface) is deleted at exit, failures included.
Needs root and ``ip netns``; :func:`unavailable_reason` says why not when they are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.77"  # one private /24, used only inside the namespaces created here
PREFIX = "mshost"
HOST_IF = "eth0"
MASTER_PORT = 29511


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of this prefix whose creating process is gone; returns their names."""
    removed = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-(br|h\d+)", name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Cluster:
    """H hosts on one bridge; use as a context manager (deletes everything on exit)."""

    hosts: int
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts must be in 1..200, got {self.hosts}")

    # ---- names -------------------------------------------------------------------------
    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def host_ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # ---- life cycle ----------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        remove_stale_namespaces()
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns = self.host_ns(i)
            self._add_ns(ns)
            # both ends are created directly inside their namespaces
            _ip(
                "-n",
                ns,
                "link",
                "add",
                HOST_IF,
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                self.bridge_ns,
            )
            _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", HOST_IF)
            _ip("-n", ns, "link", "set", HOST_IF, "up")

    def destroy(self) -> None:
        """Delete every namespace this cluster made (their interfaces go with them)."""
        while self.created:
            _ip("netns", "del", self.created.pop(), check=False)

    # ---- links ---------------------------------------------------------------------------
    def shape(self, rate_mbit: float, delay_ms: float = 0.0) -> None:
        """Limit every host's egress on its link to ``rate_mbit`` (tbf), plus netem delay."""
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 100))  # >= 10 ms of traffic
        for i in range(self.hosts):
            ns = self.host_ns(i)
            if delay_ms > 0:
                _ip_tc(
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    HOST_IF,
                    "root",
                    "handle",
                    "1:",
                    "netem",
                    "delay",
                    f"{delay_ms}ms",
                )
                parent = ["parent", "1:1", "handle", "10:"]
            else:
                parent = ["root"]
            _ip_tc(
                ns,
                "qdisc",
                "add",
                "dev",
                HOST_IF,
                *parent,
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "100ms",
            )

    def link_down(self, i: int) -> None:
        _ip("-n", self.host_ns(i), "link", "set", HOST_IF, "down")

    def if_bytes(self, i: int) -> tuple[int, int]:
        """(tx, rx) bytes of host ``i``'s link, from its /sys/class/net statistics."""
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.host_ns(i),
                "sh",
                "-c",
                f"cat /sys/class/net/{HOST_IF}/statistics/tx_bytes "
                f"/sys/class/net/{HOST_IF}/statistics/rx_bytes",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        tx, rx = out.stdout.split()
        return int(tx), int(rx)

    # ---- torchrun --------------------------------------------------------------------------
    def torchrun(
        self,
        script: str | Path,
        args: Sequence[str],
        *,
        nproc_per_node: int,
        python: str = sys.executable,
        timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        on_started=None,
        max_restarts: int = 0,
        cwd: str | Path | None = None,
    ) -> RunResult:
        """Run ``torchrun --nnodes H --nproc-per-node P script args`` with host ``i``'s ranks
        inside namespace ``i``; kills every host's process group after ``timeout_s``.
        ``on_started(cluster, procs)`` runs right after launch (fault injection). ``script``
        ``"-m"`` runs ``args[0]`` as a module."""
        procs = []
        base_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": HOST_IF}
        base_env.setdefault("OMP_NUM_THREADS", "1")
        if max_restarts:  # a new TCPStore per rendezvous round: the agents' shared store keys
            # the workers' keys by each agent's own restart count, which differ between a host
            # whose rank died and a host restarted for the membership change
            base_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        start = time.monotonic()
        try:
            for i in range(self.hosts):
                cmd = [
                    "ip",
                    "netns",
                    "exec",
                    self.host_ns(i),
                    python,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(self.hosts),
                    "--nproc-per-node",
                    str(nproc_per_node),
                    "--max-restarts",
                    str(max_restarts),
                    *self._rendezvous(i, max_restarts),
                    str(script),
                    *args,
                ]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=base_env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                        cwd=cwd,
                    )
                )
            if on_started is not None:
                on_started(self, procs)
            outputs, codes, exit_s = [], [], []
            for p in procs:
                left = max(1.0, timeout_s - (time.monotonic() - start))
                try:
                    out, _ = p.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    _kill_group(p)
                    out, _ = p.communicate()
                    out += f"\n[netns_cluster] killed after the {timeout_s:.0f} s time limit\n"
                outputs.append(out)
                codes.append(p.returncode)
                exit_s.append(time.monotonic() - start)
            return RunResult(codes, outputs, exit_s, [start + e for e in exit_s])
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
                    p.wait()

    def _rendezvous(self, i: int, max_restarts: int) -> list[str]:
        """Static rendezvous on host 0's address; with restarts c10d hosted by host 0's agent
        (the static store keeps the first round's gloo addresses, so restarted ranks would
        connect to ports that no longer listen), each agent announcing its own address."""
        endpoint = f"{self.address(0)}:{MASTER_PORT}"
        if max_restarts == 0:
            return [
                "--node-rank",
                str(i),
                "--master-addr",
                self.address(0),
                "--master-port",
                str(MASTER_PORT),
            ]
        return [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            self.prefix,
            "--rdzv-conf",
            f"is_host={str(i == 0).lower()}",
            "--local-addr",
            self.address(i),
        ]


def _ip_tc(ns: str, *args: str) -> None:
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns} failed: {proc.stderr.strip()}")


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class RunResult:
    returncodes: list[int]
    outputs: list[str]
    exit_s: list[float]  # seconds from launch until each host's torchrun had exited
    exit_at: list[float]  # time.monotonic() when each host's torchrun had exited

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.returncodes)
