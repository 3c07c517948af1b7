#!/usr/bin/env bash
# DDP on one node: one process per visible GPU (nccl), or 2 CPU processes (gloo) with no GPU.
#   bash launch/torchrun.sh --config configs/quick.yaml optim.lr=0.1     NPROC=4 to choose the count
# Every argument is passed through to ddp/train.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/launch/common.sh"
nproc=${NPROC:-$(gpu_count_or_2)}
omp_threads "$nproc"
# --preflight: ddp/train.py --preflight in torchrun's process first; it prints the command it then runs
exec python "$root/ddp/torchrun.py" --preflight="$nproc" --standalone --nproc_per_node="$nproc" "$root/ddp/train.py" "$@"
