"""A SLURM cluster over hosts made of network namespaces (tests/hosts.py): slurmctld on the first host,
a slurmd on each (NodeName and NodeAddr per host), a private munged and SLURM_CONF, its own ports,
so it never meets another cluster on this machine. ../shared/notes/namespace-hosts.md says why
slurmd is started with nsenter and not `ip netns exec` (that would hide /sys/fs/cgroup)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import clean_env, require
from hosts import Host

SBIN = "/usr/sbin:/sbin"


def _conf(state: Path, hosts: list[Host], munge_socket: Path) -> str:
    nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs=2 RealMemory=1000 State=UNKNOWN" for h in hosts)
    return f"""# tests/slurm_hosts.py: a cluster of namespace hosts, for tests only.
ClusterName=ddphosts
SlurmctldHost={hosts[0].name}({hosts[0].address})
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
CryptoType=crypto/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool-%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
SlurmctldPort=6917
SlurmdPort=6918
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerParameters=sched_interval=2
MessageTimeout=20
KillWait=10
MinJobAge=300
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def slurm_cluster(hosts: list[Host], state: Path) -> Iterator[dict[str, str]]:
    """The environment in which sbatch/srun/scontrol, run on one of `hosts`, reach the cluster."""
    tools = (("slurmctld", "slurmctld"), ("slurmd", "slurmd"), ("munged", "munge"), ("nsenter", "util-linux"))
    for tool, package in tools:
        require(tool, f"apt-get install {package}")
    state.mkdir(parents=True, exist_ok=True)
    (state / "ctld").mkdir()
    for host in hosts:
        (state / f"spool-{host.name}").mkdir()
    key, socket = state / "munge.key", state / "munge.socket"
    subprocess.run(["dd", "if=/dev/urandom", f"of={key}", "bs=1024", "count=1"], check=True, capture_output=True)
    key.chmod(0o400)
    conf = state / "slurm.conf"
    conf.write_text(_conf(state, hosts, socket))
    env = clean_env(SLURM_CONF=str(conf))
    env["PATH"] = f"{env['PATH']}:{SBIN}"
    daemons = []
    try:
        munged = ["munged", "--foreground", f"--key-file={key}", f"--socket={socket}", f"--pid-file={state}/munged.pid",
                  f"--log-file={state}/munged.log", f"--seed-file={state}/munged.seed", "--force"]  # fmt: skip
        daemons.append(subprocess.Popen(munged, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
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
