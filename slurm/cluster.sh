#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the tests and for trying slurm/train.sh locally.
#   bash slurm/cluster.sh install   apt-get install slurm-wlm, slurmctld, slurmd, munge (root, Debian/Ubuntu)
#   bash slurm/cluster.sh start     start munged, slurmctld and slurmd; prints the SLURM_CONF to export
#   bash slurm/cluster.sh status    sinfo of the running cluster (exit 1 if it does not answer)
#   bash slurm/cluster.sh stop      stop the daemons this script started
# Needs root (slurmd starts jobs as their user). Everything it writes lives in $SLURM_STATE
# (default /tmp/ddp-cifar-slurm): slurm.conf, spool, state, logs. It never touches /etc/slurm, so a
# real cluster's configuration is safe; commands find this one through SLURM_CONF.
set -euo pipefail
state=${SLURM_STATE:-/tmp/ddp-cifar-slurm}
conf=$state/slurm.conf
export SLURM_CONF=$conf
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there

die() { echo "slurm/cluster.sh: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root (slurmd runs jobs as their user)"; }

install() {
  need_root install
  command -v apt-get >/dev/null || die "no apt-get: install slurm-wlm, slurmctld, slurmd and munge with your package manager"
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    echo "slurm already installed: $(sbatch --version)"
    return
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmctld slurmd munge >/dev/null
  echo "installed $(sbatch --version)"
}

answers() { timeout 5 sinfo -h >/dev/null 2>&1; }

write_conf() {
  local node host
  node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=... RealMemory=...: what slurmd will find
  host=$(hostname -s)
  mkdir -p "$state/ctld" "$state/spool" "$state/log"
  cat >"$conf" <<EOF
# Written by slurm/cluster.sh: one node on localhost, for tests. Not for production.
ClusterName=ddpcifar
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# Requeued jobs wait this long before they may start again (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
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
# Short waits so tests see scheduling, signals and requeues within seconds.
SchedulerParameters=sched_interval=2
MessageTimeout=20
KillWait=10
MinJobAge=300
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  need_root start
  command -v slurmctld >/dev/null || die "slurm-wlm is not installed: run 'bash slurm/cluster.sh install' (root)"
  if [ -f "$conf" ] && answers; then
    echo "already running"
    echo "export SLURM_CONF=$conf"
    return
  fi
  write_conf
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create >/dev/null
    runuser -u munge -- munged
  fi
  slurmctld -f "$conf"  # -f: this conf, whatever /etc/slurm holds
  slurmd -f "$conf"
  for _ in $(seq 1 60); do
    if answers && sinfo -h -o %T | grep -qE '^(idle|mixed|allocated)'; then
      echo "started: $(sinfo -h -o '%N %c CPUs %m MB %T')"
      echo "export SLURM_CONF=$conf"
      return
    fi
    sleep 0.5
  done
  tail -n 5 "$state/log/slurmctld.log" "$state/log/slurmd.log" >&2 || true
  die "the cluster did not come up within 30 s (logs above, all in $state/log)"
}

stop() {
  for daemon in slurmd slurmctld; do
    pid_file=$state/$daemon.pid
    [ -f "$pid_file" ] || continue
    pid=$(cat "$pid_file")
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      echo "stopped $daemon"
    fi
  done
}

status() {
  answers || die "no cluster answers at SLURM_CONF=$conf (start it: bash slurm/cluster.sh start)"
  sinfo
}

case ${1:-} in
  install | start | stop | status) "$1" ;;
  *) die "usage: bash slurm/cluster.sh install|start|status|stop" ;;
esac
