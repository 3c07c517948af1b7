#!/usr/bin/env bash
# One process on one device: cuda:0 if there is a GPU, else the CPU (run.device=cuda:N to choose).
#   bash launch/single.sh --config configs/quick.yaml run.device=cpu
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/launch/common.sh"
cmd=(python "$root/ddp/train.py" run.parallel=none "$@")
shown "${cmd[@]}" >&2
exec "${cmd[@]}"
