#!/usr/bin/env bash
# bash bench/ddp_runs.sh OUT [EPOCHS]: configs/fast.yaml end to end, as a user runs it, in one process
# (python ddp/train.py) against DDP at world size 1 (torchrun, run.parallel=ddp), each eager and with
# run.cuda_graph=true, on CIFAR-10-sized synthetic data (50,000 train images: 49 steps an epoch at
# batch 1024). The four runs twice, the second time in the reverse order; OUT/ddp-runs.md: each run's
# training seconds a mean epoch from epoch 2 on (metrics.jsonl's train_s), and DDP's cost over one process.
# On a CPU (no CUDA), the dry run: toy sizes (2 epochs of 2 steps), eager only, gloo, one round; tests/test_bench.py
# runs it. make gpu-lease runs it as the probe ddp-runs (bench/gpu_probe.sh).
set -euo pipefail
out=${1:?usage: bash bench/ddp_runs.sh OUT [EPOCHS]}
epochs=${2:-3}  # the table is of epochs 2 on: at least 2
[[ $epochs =~ ^[1-9][0-9]*$ && $epochs -ge 2 ]] ||
  { echo "ddp_runs.sh: EPOCHS must be a whole number >= 2 (the table is of epochs 2 on), not '$epochs'" >&2; exit 64; }
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
job=(--config configs/fast.yaml data.dataset=synthetic data.synthetic_train=50000 data.synthetic_test=2048
  "train.epochs=$epochs" run.warmup_steps=3 run.progress=false run.resume=never run.backend=nccl)
ways=(eager recorded) rounds=2
if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  job=(--config configs/fast.yaml data.dataset=synthetic data.synthetic_train=128 data.synthetic_test=64
    train.epochs=2 train.batch_size=64 run.progress=false run.resume=never run.backend=gloo run.device=cpu
    run.amp=off run.channels_last=false model.width=0.25)
  ways=(eager) rounds=1  # run.cuda_graph is refused on a CPU
fi
mkdir -p "$out"
run() {  # run LAUNCH WAY ROUND
  local dir="$out/$1-$2-$3" graph=false
  [ "$2" = recorded ] && graph=true
  if [ "$1" = one ]; then
    "$py" ddp/train.py "${job[@]}" "run.cuda_graph=$graph" "run.out_dir=$dir" >"$dir.log" 2>&1
  else
    "$py" -m torch.distributed.run --standalone --nproc_per_node=1 ddp/train.py "${job[@]}" run.parallel=ddp \
      "run.cuda_graph=$graph" "run.out_dir=$dir" >"$dir.log" 2>&1
  fi
}
order=()
for way in "${ways[@]}"; do order+=("one $way" "ddp $way"); done
for i in "${!order[@]}"; do run ${order[$i]} 1; done
if [ $rounds = 2 ]; then for ((i = ${#order[@]} - 1; i >= 0; i--)); do run ${order[$i]} 2; done; fi
"$py" - "$out" $rounds "${ways[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, rounds, ways = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def later(launch, way, rnd):
    rows = [json.loads(line) for line in (out / f"{launch}-{way}-{rnd}" / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["train_s"] for r in rows[1:]), rows[-1]["test_acc"]
lines = ["| way | round | one process s an epoch | DDP ws1 s an epoch | DDP over one process | test acc one / DDP |",
         "| --- | ---: | ---: | ---: | ---: | --- |"]
for way in ways:
    for rnd in range(1, rounds + 1):
        (one, a1), (ddp, a2) = later("one", way, rnd), later("ddp", way, rnd)
        lines.append(f"| {way} | {rnd} | {one:.4f} | {ddp:.4f} | {ddp / one - 1:+.1%} | {a1:.2%} / {a2:.2%} |")
(out / "ddp-runs.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
