"""Real separate hosts for tests, on this one machine: Linux network namespaces, each with its own
interface and address, its own hostname and /etc/hosts, joined by a bridge that lives in a namespace
of its own, with no route out (traffic reaches only the addresses of these hosts). The filesystem
stays shared, like a cluster's NFS. Needs root and iproute2; `hosts(n)` always tears them down.

../shared/notes/namespace-hosts.md has what was seen to work here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require

SUBNET = "10.250.0"  # each set of hosts has a bridge of its own: sets never see each other's addresses
SUBNET6 = "fd0d:dc::"  # the same, where the hosts have IPv6 addresses only (a unique local prefix: no route out)
_PREFIX = "ddpc"  # netns names: ddpc<creator pid>x<set>h<n>; a dead creator's are removed as stale
_sets = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass(frozen=True)
class Host:
    name: str  # its netns name and its hostname
    address: str  # on the bridge
    device: str = "eth0"
    prefix: int = 24  # the address's network prefix length: /24, or /64 for IPv6

    def command(self, cmd: list[str]) -> list[str]:
        """`cmd` run on this host: its network, its /etc/hosts (ip netns exec), its hostname."""
        name = f'hostname {self.name} && exec "$@"'
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c", name, "sh", *cmd]

    def popen(self, cmd: list[str], cwd: Path, env: dict[str, str], cgroup: Path | None = None) -> subprocess.Popen:
        """`cmd` on this host, in a session of its own (a kill of it cannot reach pytest), output captured; in the
        cgroup whose cgroup.procs file `cgroup` is, joined before (`ip netns exec` hides /sys/fs/cgroup)."""
        join = (lambda: cgroup.write_text(str(os.getpid()))) if cgroup else None
        return subprocess.Popen(self.command(cmd), cwd=cwd, env=env, start_new_session=True, preexec_fn=join,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    def link(self, up: bool) -> None:
        """Plug this host's cable in or out."""
        ip("-n", self.name, "link", "set", self.device, "up" if up else "down")

    def pids(self) -> list[int]:
        return [int(p) for p in ip("netns", "pids", self.name, check=False).stdout.split()]

    def listens(self, port: int) -> bool:
        """Whether a program on this host listens on TCP `port`: read in /proc/PID/net of a process of
        this host (those files are its network namespace's), so no process is started to look."""
        rows = []  # sl, local address, remote address, state (0A: listening), ...
        for pid, kind in itertools.product(self.pids()[:1], ("tcp", "tcp6")):  # tcp6: where IPv6 is on
            with contextlib.suppress(OSError):
                rows += [line.split() for line in Path(f"/proc/{pid}/net/{kind}").read_text().splitlines()]
        return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows if len(row) > 3)


def _remove(names: list[str]) -> None:
    for name in names:
        for pid in [int(p) for p in ip("netns", "pids", name, check=False).stdout.split()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ip("netns", "del", name, check=False)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _remove_stale() -> None:
    """Hosts left by a test run that was killed before its teardown (its pid is gone)."""
    names = [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    stale = []
    for name in names:
        if name.startswith(_PREFIX) and (pid := name[len(_PREFIX) :].split("x")[0]).isdigit():
            if not Path(f"/proc/{pid}").exists():
                stale.append(name)
    _remove(stale)


@contextlib.contextmanager
def hosts(count: int, loopback_names: tuple[int, ...] = (), ipv6: bool = False) -> Iterator[list[Host]]:
    """`count` hosts; the ones in `loopback_names` have their own name on 127.0.1.1 in their
    /etc/hosts, as Debian and Ubuntu write it. `ipv6`: each host's address, and its name in every
    /etc/hosts, IPv6 only (an IPv6-only cluster). Torn down on the way out, whatever happens inside."""
    if os.geteuid() != 0:
        pytest.skip("hosts made of network namespaces need root (ip netns add): run the tests as root")
    require("ip", "apt-get install iproute2")
    require("unshare", "apt-get install util-linux")
    _remove_stale()
    prefix = f"{_PREFIX}{os.getpid()}x{next(_sets)}"
    switch = f"{prefix}sw"
    made = [Host(f"{prefix}h{n}", f"{SUBNET6}{n + 1}" if ipv6 else f"{SUBNET}.{n + 1}", prefix=64 if ipv6 else 24)
            for n in range(count)]  # fmt: skip
    try:
        ip("netns", "add", switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for n, host in enumerate(made):
            ip("netns", "add", host.name)
            ip("link", "add", "name", host.device, "netns", host.name, "type", "veth", "peer", "name", f"p{n}",
               "netns", switch)  # fmt: skip
            ip("-n", switch, "link", "set", f"p{n}", "master", "br0")
            ip("-n", switch, "link", "set", f"p{n}", "up")
            nodad = ["nodad"] if ipv6 else []  # usable at once, without duplicate address detection's seconds
            ip("-n", host.name, "addr", "add", f"{host.address}/{host.prefix}", "dev", host.device, *nodad)
            ip("-n", host.name, "link", "set", host.device, "up")
            ip("-n", host.name, "link", "set", "lo", "up")
        for n, host in enumerate(made):
            lines = ["127.0.0.1 localhost", *(["::1 localhost"] if ipv6 else [])]
            lines += [f"127.0.1.1 {host.name}"] if n in loopback_names else []
            lines += [f"{other.address} {other.name}" for other in made if not (other is host and n in loopback_names)]
            Path(f"/etc/netns/{host.name}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{host.name}/hosts").write_text("\n".join(lines) + "\n")
        yield made
    finally:
        _remove([host.name for host in made] + [switch])
