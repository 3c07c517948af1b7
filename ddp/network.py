"""The network between machines: whether MASTER_ADDR resolves and answers before a launch, and the
interface gloo and nccl advertise (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) when this host's own name
resolves to a loopback address (Debian and Ubuntu write `127.0.1.1 <hostname>` in /etc/hosts).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

from ddp.errors import PeerLost, UsageError

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")  # Linux: each IPv6 address, its interface and scope (20: link-local)


def host_port(host: str, port: int) -> str:
    """host:port as torchrun's --rdzv_endpoint and a tcp:// URL take it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def family(address: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 address (fd00::1, fe80::1%eth0), else AF_INET."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _ipv6(name: str | None = None) -> list[tuple[str, str]]:
    """(interface, IPv6 address) of this host's addresses, link-local ones left out; of interface `name` only."""
    try:
        rows = [line.split() for line in _IF_INET6.read_text().splitlines()]
    except OSError:  # no IPv6 here
        return []
    found = [(r[5], str(ipaddress.IPv6Address(bytes.fromhex(r[0])))) for r in rows if len(r) == 6 and r[3] != "20"]
    return [(n, a) for n, a in found if name in (None, n)]


def interface_address(name: str) -> str | None:
    """The address of interface `name`: its IPv4 address, else its first IPv6 one; None (no such interface,
    or no address on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return next((a for _, a in _ipv6(name)), None)
    return socket.inet_ntoa(packed[20:24])


def interface_with(address: str) -> str | None:
    """The interface that holds `address` (IPv4 or IPv6) on this host, or None."""
    if family(address) == socket.AF_INET6:
        wanted = ipaddress.ip_address(address.partition("%")[0])
        return next((n for n, a in _ipv6() if ipaddress.ip_address(a) == wanted), None)
    return next((n for _, n in socket.if_nameindex() if interface_address(n) == address), None)


def route_to(address: str) -> tuple[str, str] | None:
    """(interface, local address) this host sends from to reach `address` (no packet is sent), or
    None when no route leads there."""
    with socket.socket(family(address), socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError:
            return None
        local = s.getsockname()[0]
    name = interface_with(local)
    return (name, local) if name else None


def resolve(name: str) -> str | None:
    """`name`'s address, IPv4 or IPv6 (an IPv6-only cluster's), the first the resolver gives, where torch's store
    client connects first; an IPv6 address may be in brackets. None where it has none (a label of over 63
    characters is none: idna's UnicodeError)."""
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        return socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)[0][4][0] if bare else None
    except (OSError, UnicodeError, ValueError):  # ValueError: a NUL in it
        return None


def unresolved(master: str, host: str) -> str:
    """Why MASTER_ADDR=`master` has no address on `host`, with the fix: a port in it, a name."""
    name, colon, port = master.rpartition(":")
    if colon and port.isdigit() and resolve(name):
        return f"MASTER_ADDR={master} holds a port: MASTER_ADDR={name.strip('[]')} MASTER_PORT={port}"
    if ":" in master:
        return f"MASTER_ADDR={master} is no address or host name: give the master's IPv4 or IPv6 address, or its name"
    return f"MASTER_ADDR={master} does not resolve on {host}: check the name, or this host's /etc/hosts"


def scoped(what: str) -> str:
    """Why an IPv6 address with its interface (fe80::1%eth0, link-local) in `what` will not do, with the fix."""
    zone = what.partition("%")[2].partition("]")[0]
    return (f"{what} is an IPv6 address with its interface (%{zone}), a link-local one, which torch's rendezvous "
            "does not take: give the master's global or unique-local address (ip -6 addr show scope global), its "
            "IPv4 address or its name")  # fmt: skip


def own_interfaces() -> dict[str, str]:
    """{interface: address} of this host (its IPv4 address, else its IPv6 one), loopback left out."""
    found = {name: interface_address(name) for _, name in socket.if_nameindex()}
    return {name: a for name, a in found.items() if a and not ipaddress.ip_address(a).is_loopback}


def pick_interface(master: str, spans_machines: bool, env: MutableMapping[str, str] = os.environ) -> str | None:
    """When this host's name resolves to a loopback address, gloo and nccl advertise it and the other
    machines of the job cannot reach this one. Then GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (unless
    set) name the interface that routes to `master` (MASTER_ADDR), or on the master itself its one
    interface. Returns what was done, for the log; None when nothing had to be; UsageError when no
    interface will do."""
    host = socket.gethostname()
    if named := env.get("GLOO_SOCKET_IFNAME"):
        check_named_interfaces(named, host)
        return None
    own, to = resolve(host), resolve(master)
    if not spans_machines or own is None or to is None:
        return None
    if not ipaddress.ip_address(own).is_loopback:
        return None  # the name resolves to an address the other machines reach
    if ipaddress.ip_address(to).is_loopback and master.split(".")[0] != host.split(".")[0]:
        return None  # MASTER_ADDR=127.0.0.1: every node of this job is this machine
    if not ipaddress.ip_address(to).is_loopback:
        route = route_to(to)
        choice = {route[0]: route[1]} if route else {}
    else:  # this host is MASTER_ADDR: the other machines reach it on its own interface, if it has one
        choice = own_interfaces()
    if len(choice) != 1:
        found = ", ".join(f"{n} ({a})" for n, a in own_interfaces().items()) or "none"
        raise UsageError(
            f"this host's name {host} resolves to {own} (loopback), so gloo/nccl would tell the other machines an "
            f"address they cannot reach, and no one interface reaches MASTER_ADDR={master} (interfaces: {found}): "
            f"map {host} to its own address in /etc/hosts, or set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME)"
        )
    name, local = next(iter(choice.items()))
    env["GLOO_SOCKET_IFNAME"] = name
    env.setdefault("NCCL_SOCKET_IFNAME", name)
    return f"{host} resolves to {own}: gloo/nccl use {name} ({local}), the interface to MASTER_ADDR={master}"


def check_named_interfaces(named: str, host: str) -> None:
    """GLOO_SOCKET_IFNAME=`named` (comma-separated names, as gloo takes them): UsageError for one this machine lacks,
    or that has no address (copied from another cluster's job script, eth0 where this one has ens5: every rank's
    rendezvous failed, exit 1, in gloo's `enforce fail ... Unable to find address for: eth0`)."""
    lacking = [name for name in named.split(",") if name and interface_address(name) is None]
    if lacking:
        found = {name: interface_address(name) for _, name in socket.if_nameindex()}
        listed = ", ".join(f"{name} ({address})" for name, address in found.items() if address) or "none"
        raise UsageError(
            f"GLOO_SOCKET_IFNAME={named}: this machine ({host}) has no interface {lacking[0]!r} with an address "
            f"(its interfaces: {listed}); name one of them, or unset it"
        )


def check_master(master: str, port: int, node_rank: int, timeout_s: float) -> None:
    """Before a launch on several machines (launch/multinode.sh, every node): MASTER_ADDR resolves here;
    on node 0 the rendezvous port is free; from a node other than 0 it answers within `timeout_s` (node 0
    may start later). A name that does not resolve or a port taken is a UsageError; no answer, PeerLost.
    torchrun itself waits without end on both, or fails with two tracebacks."""
    host = socket.gethostname()
    if not master:  # (a NODE_RANK set by hand: the launch files need MASTER_ADDR with it)
        raise UsageError(f"NODE_RANK={node_rank} is set, and MASTER_ADDR is not: on each of several machines, set "
                         "it to node 0's address; on one machine, unset NODE_RANK")  # fmt: skip
    if "%" in master:
        raise UsageError(scoped(f"MASTER_ADDR={master}"))
    to = resolve(master)
    if to is None:
        raise UsageError(unresolved(master, host))
    if node_rank == 0:
        check_port_free(port)
    deadline, last = time.monotonic() + timeout_s, None
    while node_rank != 0 and time.monotonic() < deadline:
        last = connect_error(to, port, max(0.1, min(5.0, deadline - time.monotonic())))
        if last is not None:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            continue
        if store_answers(to, port, min(timeout_s, 15.0)):
            return
        raise UsageError(
            f"MASTER_ADDR={host_port(master, port)} ({to}) accepts connections from {host} but does not answer as "
            "torchrun's rendezvous store: another program on that port? Set MASTER_PORT to the port "
            "NODE_RANK=0 uses (the same on every node)"
        )
    if last is not None:
        why = "the connection attempts time out: a firewall that drops them?" if isinstance(last, TimeoutError) \
            else f"{last.strerror or last}: is NODE_RANK=0 started there?"  # fmt: skip
        raise PeerLost(
            f"MASTER_ADDR={host_port(master, port)} ({to}) did not answer {host} within run.timeout_s={timeout_s:g} s "
            f"({why}); "
            "start NODE_RANK=0 on that host, open the port, or check MASTER_ADDR"
        )


def connect_error(host: str, port: int, timeout: float) -> OSError | None:
    """Why a TCP connection to host:port fails within `timeout` (refused, timed out, ...); None: accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return e


_PROBE = (
    "import datetime, sys, torch.distributed as d; d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, "
    "timeout=datetime.timedelta(seconds=float(sys.argv[3]))).check(['ddp-cifar-probe'])"
)


def store_answers(addr: str, port: int, seconds: float) -> bool:
    """Whether a torch TCPStore (torchrun's rendezvous store) answers at addr:port within `seconds`. In
    a process of its own: a TCPStore client facing another program can wait past its own timeout."""
    try:
        probe = [sys.executable, "-c", _PROBE, addr, str(port), str(seconds)]
        return subprocess.run(probe, capture_output=True, timeout=seconds + 10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def check_port_free(port: int) -> None:
    """On the host that serves the rendezvous: `port` free to listen on, as torchrun's store will (a
    closed run's connections in TIME_WAIT do not count). Else one UsageError naming the program that
    holds it, where /proc shows it, and a free port to take instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
            return
        except OSError as e:
            why = e.strerror or str(e)
    holder = listener(port)
    raise UsageError(
        f"MASTER_PORT={port} is taken on {socket.gethostname()} ({why}{f': {holder}' if holder else ''}); "
        f"the rendezvous listens there: set another free port on every node, e.g. MASTER_PORT={free_port()}"
    )


def free_port() -> int:
    """A TCP port free here now (the system's pick), for a rendezvous on this machine alone."""
    with socket.socket() as free:
        free.bind(("", 0))
        return free.getsockname()[1]


def listener(port: int) -> str | None:
    """'pid N (its command line)' of the process listening on TCP `port` here, from /proc (Linux; a
    process of another user is seen by root only); None if none is found."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = [line.split() for line in Path(table).read_text().splitlines()[1:]]
        except OSError:
            continue
        inodes |= {
            f"socket:[{r[9]}]" for r in rows if len(r) > 9 and r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port
        }
    for fd in Path("/proc").glob("[0-9]*/fd/*") if inodes else []:
        try:
            if os.readlink(fd) in inodes:
                pid = fd.parent.parent.name
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"pid {pid} ({command.strip()})"
        except OSError:
            continue
    return None


def gloo_interface(env: MutableMapping[str, str] = os.environ) -> str:
    """For the doctor: the interface and address gloo (and nccl's bootstrap) use on this host."""
    if env.get("GLOO_SOCKET_IFNAME"):
        name = env["GLOO_SOCKET_IFNAME"]
        return f"{name} ({interface_address(name)}, GLOO_SOCKET_IFNAME)"
    own = resolve(socket.gethostname())
    if own is None:
        return "none: this host's name does not resolve (gloo falls back to loopback)"
    if ipaddress.ip_address(own).is_loopback:
        return f"lo ({own}, this host's name): right on one machine, out of other machines' reach"
    return f"{interface_with(own) or '?'} ({own}, this host's name)"
