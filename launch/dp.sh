#!/usr/bin/env bash
# One process, nn.DataParallel over every visible GPU (needs 2 or more; DDP via torchrun.sh is faster).
#   CUDA_VISIBLE_DEVICES=0,1 bash launch/dp.sh --config configs/resnet18.yaml
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/launch/common.sh"
cmd=(python "$root/ddp/train.py" run.parallel=dp "$@")
shown "${cmd[@]}" >&2
exec "${cmd[@]}"
