#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the tests and for trying slurm/train.sh locally.
#   bash slurm/cluster.sh install   apt-get install slurm-wlm, slurmctld, slurmd, munge (root, Debian/Ubuntu)
#   bash slurm/cluster.sh start     start munged, slurmctld and slurmd; prints the SLURM_CONF to export
#   bash slurm/cluster.sh status    sinfo of the running cluster (exit 1 if it does not answer)
#   bash slurm/cluster.sh stop      stop the daemons this script started
#   bash slurm/cluster.sh conf      write the slurm.conf alone (SLURM_NODES: several nodes; see write_conf)
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
  # One node, this machine, by default. SLURM_NODES="name:address ...": one node each, slurmctld on the
  # first (tests/slurm_hosts.py: hosts made of network namespaces, which start their own daemons);
  # MUNGE_SOCKET: a munged of their own.
  local nodes ctld spool=$state/spool slurmd_pid=$state/slurmd.pid slurmd_log=$state/log/slurmd.log n
  mkdir -p "$state/ctld" "$state/log"
  if [ -n "${SLURM_NODES:-}" ]; then
    nodes=""
    for n in $SLURM_NODES; do
      nodes+="NodeName=${n%%:*} NodeAddr=${n#*:} CPUs=2 RealMemory=1000 State=UNKNOWN"$'\n'
      mkdir -p "$state/spool-${n%%:*}"
    done
    n=${SLURM_NODES%% *}
    ctld="${n%%:*}(${n#*:})" spool=$state/spool-%n slurmd_pid=$state/slurmd-%n.pid
    slurmd_log=$state/log/slurmd-%n.log
  else
    nodes="$(slurmd -C | head -n 1) NodeAddr=127.0.0.1 State=UNKNOWN"  # what slurmd will find
    ctld="$(hostname -s)(127.0.0.1)"
    mkdir -p "$spool"
  fi
  cat >"$conf" <<EOF
# Written by slurm/cluster.sh: a cluster for tests. Not for production.
ClusterName=ddpcifar
SlurmctldHost=$ctld
SlurmUser=root
AuthType=auth/munge
# Requeued jobs wait this long before they may start again (default 120 s).
AuthInfo=${MUNGE_SOCKET:+socket=$MUNGE_SOCKET,}cred_expire=10
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$slurmd_log
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
# Preemption: a job of partition urgent takes the CPUs of one of debug, which SLURM sends SIGTERM and cancels
# GraceTime s later (CANCEL: what brings such a job back is its own requeue, rank 0's, within that time).
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
$nodes
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2
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
  stop >/dev/null  # what is left of a cluster that no longer answers
  write_conf
  # The default socket must answer: a munged of another cluster (tests/slurm_hosts.py: its own socket)
  # does not serve this one, and slurmctld would wait on it for minutes.
  if ! munge -n >/dev/null 2>&1; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create >/dev/null
    runuser -u munge -- munged
  fi
  # -c: a cold start begins with an empty queue. The jobs that the state files still record died with
  # the daemons (a reboot, a kill); recovered, they would stay RUNNING forever and hold the node.
  slurmctld -c -f "$conf"  # -f: this conf, whatever /etc/slurm holds
  slurmd -f "$conf"
  local deadline=$((SECONDS + 30))  # by the clock: each sinfo may take its 5 s
  while [ "$SECONDS" -lt "$deadline" ]; do
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
    # After a reboot the file may name another process: stop it only if it is this daemon.
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$daemon" ] || continue
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
  conf) write_conf && echo "$conf" ;;
  *) die "usage: bash slurm/cluster.sh install|start|status|stop|conf" ;;
esac
