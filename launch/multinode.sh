#!/usr/bin/env bash
# DDP across machines: run this on every node with the same NNODES, MASTER_ADDR and MASTER_PORT.
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash launch/multinode.sh --config configs/resnet18.yaml
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash launch/multinode.sh --config configs/resnet18.yaml
# c10d rendezvous: node 0 (MASTER_ADDR, reachable from every node) hosts it on MASTER_PORT (default
# 29400); ranks are numbered node by node as they join. NPROC processes per node (default: its GPUs,
# or 2 CPU processes). RDZV_ID names the job, so two jobs on one address do not mix. run.out_dir
# must be on a filesystem every node sees (rank 0 writes, every rank reads to resume).
# Every argument is passed through to ddp/train.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
: "${NNODES:?set NNODES (how many machines)}" "${NODE_RANK:?set NODE_RANK (0 on the machine at MASTER_ADDR)}"
: "${MASTER_ADDR:?set MASTER_ADDR (the address of node 0, as the other nodes reach it)}"
source "$root/launch/common.sh"
nproc=${NPROC:-$(gpu_count_or_2)}
omp_threads "$nproc"
# On every node: the config, the data, MASTER_ADDR resolving (and, from the other nodes, answering
# within run.timeout_s: torchrun would wait without end); node 0 also takes and checks the lock.
preflight $((NNODES * nproc)) "$@"
is_host=$([ "$NODE_RANK" = 0 ] && echo true || echo false)  # node 0 serves the rendezvous store
cmd=(torchrun --nnodes="$NNODES" --nproc_per_node="$nproc" --rdzv_backend=c10d
  --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29400}" --rdzv_id="${RDZV_ID:-ddp-cifar}"
  --rdzv_conf=is_host="$is_host" "$root/ddp/train.py" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
