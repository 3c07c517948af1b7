#!/usr/bin/env bash
# airbench94, configs/fast.yaml and fast.yaml with run.amp=fp16-weights (airbench's own precision: no autocast,
# fp16 weights) in interleaved rounds in one device call, so that the epochs-after-the-first ratio comes with its
# spread across processes (one process of each moved it by 1.14x-1.50x in one call, 2026-11-27). (Until
# 2026-11-27 the third run was run.warmup_steps=5, one lookahead move inside the warm-up: no different from 3.)
#   bash bench/gpu_rounds.sh [--dry-run] [ROUNDS]     (default 3; after `make gpu-carry`, carry .gpu)
# Round k runs them in turn, the order reversed in every other round; each round's table
# (bench/gpu_summary.py --later-epochs) goes to rounds.md. The work is in $GPU_ROUNDS_DIR (default
# /tmp/gpu-rounds) and packed into $OUT/gpu-rounds.tgz after each run, so a call cut off brings back
# what was done. --dry-run: the CPU, toy sizes, no airbench, float32 throughout (tests/test_gpu_check.py; fp16
# convolutions are 100x slower on a CPU: tests/test_train.py trains fp16-weights).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dry=0
[ "${1:-}" = --dry-run ] && dry=1 && shift
rounds=${1:-3}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "gpu_rounds.sh: ROUNDS must be a whole number >= 1, not '$rounds'" >&2; exit 64; }
export PYTHONPATH="$root" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
work=${GPU_ROUNDS_DIR:-/tmp/gpu-rounds}
dest=${OUT:-$root/bench/results/gpu-check}
data=$root/.gpu/cifar10-subset.npz
airbench=$(ls "$root"/.gpu/airbench-*.tar.gz 2>/dev/null | head -1)
sizes=() fp16w=(run.amp=fp16-weights)
if [ $dry = 1 ]; then
  fp16w=()
  sizes=(data.dataset=synthetic data.synthetic_train=128 data.synthetic_test=64 train.epochs=2 train.batch_size=64
    model.width=0.25 run.device=cpu run.amp=off run.channels_last=false run.cudnn_benchmark=false)
else
  [ -f "$data" ] && [ -n "$airbench" ] || { echo "gpu_rounds.sh: no .gpu/ subset or airbench: make gpu-carry" >&2; exit 64; }
  sizes=(data.dataset=npz "data.path=$data")
fi
[ "$(realpath -m "$work")" = "$(realpath -m "$dest")" ] && { echo "gpu_rounds.sh: GPU_ROUNDS_DIR is \$OUT: name another" >&2; exit 64; }
[ -e "$work" ] && [ ! -f "$work/.gpu-rounds" ] && { echo "gpu_rounds.sh: $work is not this script's" >&2; exit 64; }
rm -rf "$work" && mkdir -p "$work" "$dest" && touch "$work/.gpu-rounds" || exit 64

fast() {  # fast DIR [SETTING...]
  "$py" ddp/train.py --config configs/fast.yaml "${sizes[@]}" run.warmup_steps=3 run.resume=never \
    run.progress=false "run.out_dir=$1" "${@:2}" >"$1.log" 2>&1
}
one() {  # one ROUND_DIR NAME
  case $2 in
    airbench) [ $dry = 1 ] || "$py" bench/airbench_subset.py --data "$data" --airbench "$airbench" \
      --out "$1/airbench.json" >"$1/airbench.log" 2>&1 ;;
    fast) fast "$1/fast" ;;  # gpu_check.sh's fast step
    fast-fp16w) fast "$1/fast-fp16w" "${fp16w[@]}" ;;
  esac || echo "gpu_rounds.sh: $2 in $1 failed (its log beside it)" >&2
  tar czf "$dest/gpu-rounds.tgz.part" --exclude="*.pt" -C "$(dirname "$work")" "$(basename "$work")" &&
    mv -f "$dest/gpu-rounds.tgz.part" "$dest/gpu-rounds.tgz"
}
order=(airbench fast fast-fp16w)
for k in $(seq 1 "$rounds"); do
  dir=$work/round$k
  mkdir -p "$dir"
  names=("${order[@]}")
  [ $((k % 2)) = 0 ] && names=(fast-fp16w fast airbench)
  for name in "${names[@]}"; do one "$dir" "$name"; done
  { echo "## round $k (${names[*]})"; "$py" bench/gpu_summary.py --later-epochs "$dir" "$dir/fast-fp16w"; echo
    for run in fast fast-fp16w; do  # the first epoch, which the table above leaves out, and the warm-up
      "$py" -c 'import json, sys; m = json.loads(open(sys.argv[1]).readline())
print("%s: epoch 1 %.4f s of training, warm-up %.1f s" % (sys.argv[2], m["train_s"], m["warmup_s"]))' \
        "$dir/$run/metrics.jsonl" "$run"
    done; echo; } >>"$work/rounds.md" 2>&1
done
cp "$work/rounds.md" "$dest/rounds.md"
cat "$work/rounds.md"
