#!/usr/bin/env bash
# DDP across machines: run this on every node with the same NNODES, MASTER_ADDR and MASTER_PORT.
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash launch/multinode.sh --config configs/resnet18.yaml
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash launch/multinode.sh --config configs/resnet18.yaml
# c10d rendezvous: node 0 (MASTER_ADDR, reachable from every node: a name, an IPv4 or an IPv6 address) hosts it
# on MASTER_PORT (default 29400); ranks are numbered node by node as they join. NPROC processes per node (default: its GPUs,
# or 2 CPU processes). RDZV_ID names the job, so two jobs on one address do not mix. run.out_dir
# must be on a filesystem every node sees (rank 0 writes, every rank reads to resume).
# RDZV_CONF adds torchrun --rdzv_conf settings (e.g. last_call_timeout=5). Every argument is passed
# through to ddp/train.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
: "${NNODES:?set NNODES (how many machines)}" "${NODE_RANK:?set NODE_RANK (0 on the machine at MASTER_ADDR)}"
: "${MASTER_ADDR:?set MASTER_ADDR (the address of node 0, as the other nodes reach it)}"
# MIN_NODES < NNODES: an elastic job. When a node is lost, torchrun restarts the ranks left (up to
# MAX_RESTARTS times, default 3) on the nodes still there, from the last checkpoint; set
# train.micro_batch_size so that the global batch stays the same on the smaller world.
source "$root/launch/common.sh"
machines NNODES "$NNODES" NODE_RANK "$NODE_RANK"
nodes=$NNODES restarts=${MAX_RESTARTS:-0}
if [ -n "${MIN_NODES:-}" ]; then
  whole MIN_NODES "$MIN_NODES" "1 to NNODES=$NNODES"
  ((MIN_NODES >= 1 && MIN_NODES <= NNODES)) || { echo "error: MIN_NODES=$MIN_NODES must be 1 to NNODES=$NNODES" >&2; exit 2; }
  nodes="$MIN_NODES:$NNODES" restarts=${MAX_RESTARTS:-3}
fi
whole MAX_RESTARTS "$restarts"
# RDZV_CONF's pairs, checked here: torchrun would end in a traceback (is_host is this script's: from NODE_RANK)
if [ -n "${RDZV_CONF:-}" ]; then
  [[ $RDZV_CONF =~ ^[a-z_]+=[^,=]+(,[a-z_]+=[^,=]+)*$ ]] ||
    { echo "error: RDZV_CONF=$RDZV_CONF must be key=value pairs joined by commas, e.g. last_call_timeout=5" >&2; exit 2; }
  IFS=, read -ra pairs <<<"$RDZV_CONF"
  for pair in "${pairs[@]}"; do
    [ "${pair%%=*}" != is_host ] ||
      { echo "error: RDZV_CONF may not set is_host: this script does (node 0, NODE_RANK=0, hosts the store)" >&2; exit 2; }
    [[ ! ${pair%%=*} =~ (timeout|interval|attempt)$ || ${pair#*=} =~ ^[0-9]+$ ]] ||
      { echo "error: RDZV_CONF's $pair must be a whole number (seconds, or attempts)" >&2; exit 2; }
  done
fi
nproc=${NPROC:-$(gpu_count_or_2)}
omp_threads "$nproc"
# --preflight, on every node in torchrun's process first: the config, the data, MASTER_ADDR resolving (and, from
# the other nodes, answering within run.timeout_s: torchrun would wait without end); node 0 also takes and
# checks the lock. It prints the command it then runs.
is_host=$([ "$NODE_RANK" = 0 ] && echo true || echo false)  # node 0 serves the rendezvous store
exec python "$root/ddp/torchrun.py" --preflight=$((NNODES * nproc)) --nnodes="$nodes" --nproc_per_node="$nproc" \
  --rdzv_backend=c10d --max-restarts="$restarts" \
  --rdzv_endpoint="$(endpoint "$MASTER_ADDR" "${MASTER_PORT:-29400}")" --rdzv_id="${RDZV_ID:-ddp-cifar}" \
  --rdzv_conf="is_host=$is_host${RDZV_CONF:+,$RDZV_CONF}" "$root/ddp/train.py" "$@"
