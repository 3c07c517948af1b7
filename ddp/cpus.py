"""The CPUs this process may use: its affinity (taskset; a cpuset: SLURM's, Docker's --cpuset-cpus) and its
cgroup's CPU quota (Docker's --cpus, Kubernetes' limits.cpu). torch's default thread count sees the first only,
and `getconf _NPROCESSORS_ONLN` neither: threads beyond a quota are throttled, and wait for each other.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PROC = Path("/proc/self")


def affinity() -> int:
    """How many CPUs this process may run on (taskset, a cpuset); all of the machine's where the system does not say
    (macOS has no sched_getaffinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def usable(proc: Path = PROC) -> int:
    """How many CPUs this process may keep busy: its affinity's, at most its cgroups' quota rounded up; at least 1."""
    cpus = affinity()
    quota = cgroup_quota(proc)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def threads(processes: int, proc: Path = PROC) -> int:
    """Threads for each of `processes` processes on this machine that share its usable CPUs: at least 1."""
    return max(1, usable(proc) // max(1, processes))


def cgroup_quota(proc: Path = PROC) -> float | None:
    """The CPU time a second that this process's cgroup and those above it allow, the least of them (2.0: two
    CPUs' worth), from cgroup v2's cpu.max or v1's cpu.cfs_quota_us; None where none is set or none can be read."""
    try:
        groups = _groups((proc / "cgroup").read_text())
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in mounts:
        fields = line.split()
        if "-" not in fields:
            continue
        rest = fields[fields.index("-") + 1 :]
        root, mount, kind, options = fields[3], fields[4], rest[0], rest[2:3]
        if kind == "cgroup2" and "" in groups:
            path = groups[""]
        elif kind == "cgroup" and options and "cpu" in options[0].split(",") and "cpu" in groups:
            path = groups["cpu"]
        else:
            continue
        found += _limits(Path(mount), root, path)
    return min(found, default=None)


def _groups(text: str) -> dict[str, str]:
    """/proc/self/cgroup as {controller: path}; cgroup v2's under ""."""
    groups = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


def _limits(mount: Path, root: str, path: str) -> list[float]:
    """The quotas from the process's cgroup `path` up to the mount's root (a container's whole tree where `path`
    is not under the mount's `root`, as without a cgroup namespace), as CPUs."""
    relative = os.path.relpath(path, root) if os.path.commonpath([root, path]) == root else "."
    here, limits = mount / relative, []
    while True:
        if (quota := _quota(here)) is not None:
            limits.append(quota)
        if here == mount or mount not in here.parents:
            return limits
        here = here.parent


def _quota(group: Path) -> float | None:
    """One cgroup's quota as CPUs (v2's cpu.max "max 100000" or "200000 100000", v1's cpu.cfs_quota_us and
    cpu.cfs_period_us, -1 for none); None where it sets none."""
    try:
        if (group / "cpu.max").is_file():
            quota, period = (group / "cpu.max").read_text().split()[:2]
        else:
            quota, period = ((group / f"cpu.cfs_{name}_us").read_text().strip() for name in ("quota", "period"))
        cpus = (int(quota) if quota != "max" else -1) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return cpus if cpus > 0 else None
