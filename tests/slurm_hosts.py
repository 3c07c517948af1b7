"""A SLURM cluster over hosts made of network namespaces (tests/hosts.py): slurmctld on the first host,
a slurmd on each (NodeName and NodeAddr per host: slurm/cluster.sh conf with SLURM_NODES), a private
munged and SLURM_CONF, its own ports, so it never meets another cluster on this machine.
../shared/notes/namespace-hosts.md says why slurmd is started with nsenter and not `ip netns exec`
(that would hide /sys/fs/cgroup)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, clean_env, require
from hosts import Host

CLUSTER = REPO / "slurm" / "cluster.sh"  # writes the slurm.conf; the daemons start here, in each host's namespaces

SBIN = "/usr/sbin:/sbin"


@contextlib.contextmanager
def slurm_cluster(hosts: list[Host], state: Path) -> Iterator[dict[str, str]]:
    """The environment in which sbatch/srun/scontrol, run on one of `hosts`, reach the cluster."""
    tools = (("slurmctld", "slurmctld"), ("slurmd", "slurmd"), ("munged", "munge"), ("nsenter", "util-linux"))
    for tool, package in tools:
        require(tool, f"apt-get install {package}")
    state.mkdir(parents=True, exist_ok=True)
    socket = state / "munge.socket"
    nodes = " ".join(f"{h.name}:{h.address}" for h in hosts)
    env = clean_env(
        SLURM_STATE=str(state), SLURM_NODES=nodes, MUNGE_SOCKET=str(socket), SLURMCTLD_PORT="6917", SLURMD_PORT="6918"
    )  # fmt: skip (its own ports: never another cluster on this machine)
    env["PATH"] = f"{env['PATH']}:{SBIN}"
    written = subprocess.run(["bash", str(CLUSTER), "conf"], env=env, capture_output=True, text=True, check=True)
    conf = written.stdout.strip()
    env["SLURM_CONF"] = conf
    daemons = []
    try:
        daemons.append(private_munged(state))
        daemons.append(subprocess.Popen(hosts[0].command(["slurmctld", "-D", "-f", str(conf)]), env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        for host in hosts:
            start = (f"mount --bind /etc/netns/{host.name}/hosts /etc/hosts && hostname {host.name} && "
                     f"exec slurmd -D -f {conf}")  # fmt: skip
            cmd = ["nsenter", f"--net=/run/netns/{host.name}", "unshare", "--mount", "--uts", "bash", "-c", start]
            daemons.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for_nodes(hosts, env, state)
        yield env
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(state, ignore_errors=True)


def private_munged(state: Path) -> subprocess.Popen:
    """A munged of its own (key and socket in `state`), beside any other on this machine."""
    state.mkdir(parents=True, exist_ok=True)
    key, socket = state / "munge.key", state / "munge.socket"
    subprocess.run(["dd", "if=/dev/urandom", f"of={key}", "bs=1024", "count=1"], check=True, capture_output=True)
    key.chmod(0o400)
    munged = ["munged", "--foreground", f"--key-file={key}", f"--socket={socket}", f"--pid-file={state}/munged.pid",
              f"--log-file={state}/munged.log", f"--seed-file={state}/munged.seed", "--force"]  # fmt: skip
    return subprocess.Popen(munged, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_nodes(hosts: list[Host], env: dict[str, str], state: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(
            hosts[0].command(["sinfo", "-h", "-N", "-o", "%N %T"]), env=env, capture_output=True, text=True
        )  # fmt: skip (one line a node)
        if sum(line.split()[-1] in ("idle", "mixed") for line in shown.stdout.splitlines()) >= len(hosts):
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-1500:] for p in sorted(state.glob("*.log")))
    pytest.fail(f"the SLURM cluster of {len(hosts)} hosts did not come up within {timeout:g} s:\n{logs}")
