#!/usr/bin/env bash
# The system packages the launcher tests run for real: SLURM (slurm-wlm, slurmctld, slurmd, munge) for
# tests/test_slurm.py, Open MPI (openmpi-bin) and MPICH (mpich) for accelerate's CPU mode in tests/test_launch.py, and
# iproute2 and iptables for the hosts made of network namespaces in tests/test_hosts.py. Intel MPI, the third MPI of
# accelerate's CPU mode, is no Debian package: its runtime comes from PyPI (impi-rt) into $INTEL_MPI (its own folder,
# so that its mpirun never stands before the system's on a PATH).
# `make test` runs this first. As root on Debian/Ubuntu it installs what is missing (quietly; the
# apt-get output is shown only if it fails); elsewhere it says what to install, and those tests
# skip with the same reason.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # slurmctld, slurmd and munged live there
INTEL_MPI=/opt/ddp-cifar/intel-mpi  # (tests/test_launch.py's INTEL_MPI)
if [ ! -x "$INTEL_MPI/bin/mpirun" ] && [ "$(id -u)" = 0 ]; then
  echo "make test: installing Intel MPI's runtime (PyPI's impi-rt) into $INTEL_MPI" >&2
  log=$(mktemp)
  # (2021.13.1: the later ones need libfabric from PyPI, which has none for them)
  python3 -m pip install --no-deps --target "$INTEL_MPI" impi-rt==2021.13.1 >"$log" 2>&1 ||
    { cat "$log" >&2; echo "make test: pip install impi-rt failed (above)" >&2; rm -f "$log"; exit 1; }
  rm -f "$log"
fi
missing=()
command -v slurmctld >/dev/null && command -v slurmd >/dev/null || missing+=(slurm-wlm slurmctld slurmd)
command -v munged >/dev/null || missing+=(munge)
mpirun --version 2>/dev/null | grep -q "Open MPI" || missing+=(openmpi-bin)  # (the system's mpirun: Open MPI's)
command -v mpirun.mpich >/dev/null || missing+=(mpich)  # (Open MPI stays the system's mpirun)
command -v ip >/dev/null || missing+=(iproute2)
command -v iptables >/dev/null || missing+=(iptables)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "make test: ${missing[*]} not installed, and installing needs root and apt-get: the SLURM/MPI" \
    "launcher tests will skip. To run them: sudo apt-get install ${missing[*]}" >&2
  exit 0
fi
echo "make test: installing ${missing[*]} with apt-get (for the SLURM and MPI launcher tests)" >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "make test: apt-get install ${missing[*]} failed (above)" >&2
  exit 1
fi
