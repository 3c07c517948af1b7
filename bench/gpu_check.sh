#!/usr/bin/env bash
# make gpu-check (= bash bench/gpu_check.sh [--dry-run]): every CUDA path of ddp-cifar run on the GPU
# machine and measured, in one command of under 9 minutes on one H100, needing nothing but what that
# machine has (no internet, no pip install from a registry: the project runs from the checkout with
# PYTHONPATH=.). Each step's log and figures go under one folder, GPU_CHECK_OUT (default: $OUT, the
# device tool's, else bench/results/gpu-check), with summary.md last:
#   env        nvidia-smi, torch, the GPU
#   tests      pytest tests/test_gpu.py and the other files with a CUDA branch (test_evaluate, test_sync_bn)
#   bench      python -m bench: images/s, one-batch ceiling, MFU, DDP overhead, startup, peak memory
#   fast, resnet18   time to accuracy of configs/fast.yaml (after 3 warm-up steps) and configs/resnet18.yaml on the subset
#   ranks      2 and 3 ranks on the one GPU (run.backend=gloo), each killed at a step and resumed; 1 rank nccl
#   fsdp       run.parallel=fsdp beside ddp (bench/fsdp_memory.py): 1 rank nccl, 2 ranks sharing the GPU with gloo
#   airbench   airbench94 (PyPI airbench 0.1.8) on the same subset: its time and accuracy beside ours
#   lightning  Lightning training the same net with the same recipe, DDP on the one GPU (bench/lightning_fast.py)
# STEP...: only those steps (e.g. `bash bench/gpu_check.sh bench` in a device call of its own, the
# others in another: one call has 10 minutes); none named: all of them.
# bench/gpu_lease.sh (make gpu-lease) runs steps of it in one device call and packs what they wrote.
# Before the device call, here (once): `make gpu-carry` puts the subset and airbench's source archive
# into .gpu/ (git-ignored); the call carries it: run(command="bash bench/gpu_check.sh", carry=[".gpu"]).
# --dry-run: the same steps on this machine's CPU at toy sizes (tests/test_gpu_check.py runs it), so
# the script cannot fail on the GPU machine for a typo. Exit status: the number of failed steps.
# Run again into the same folder, it replaces the earlier check's run folders (fast, resnet18, ranks-N).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dry=0
[ "${1:-}" = --dry-run ] && dry=1 && shift
only=("$@")
known=" env tests bench fast resnet18 ranks fsdp airbench lightning "
for name in "${only[@]}"; do
  [[ $known == *" $name "* ]] || { echo "gpu_check.sh: no step '$name' (steps:$known)" >&2; exit 64; }
done
out=${GPU_CHECK_OUT:-${OUT:-$root/bench/results/gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
data=${GPU_CHECK_DATA:-$root/.gpu/cifar10-subset.npz}
[ -f "$data" ] || data="$root/../shared/data/cifar10-subset.npz"
airbench=$(ls "$root"/.gpu/airbench-*.tar.gz 2>/dev/null | head -1)
failed=()
summary=("| step | result | log |" "| --- | --- | --- |")

wanted() {  # wanted NAME: whether this check runs step NAME
  [ ${#only[@]} = 0 ] || [[ " ${only[*]} " == *" $1 "* ]]
}

step() {  # step NAME COMMAND...: run it, its output in $out/NAME.log; remember how it went
  local name=$1 started=$SECONDS
  shift
  wanted "$name" || return 0
  echo "== $name: $*"
  if "$@" >"$out/$name.log" 2>&1; then
    summary+=("| $name | ok ($((SECONDS - started)) s) | $name.log |")
  else
    local code=$?
    failed+=("$name")
    summary+=("| $name | FAILED, exit $code ($((SECONDS - started)) s) | $name.log |")
    tail -n 15 "$out/$name.log" | sed 's/^/   /'
  fi
}

if [ $dry = 1 ]; then  # the CPU: toy sizes, gloo, fp32
  train_sizes=(train.epochs=1 train.batch_size=64 run.device=cpu run.amp=off run.channels_last=false run.tf32=false
    run.cudnn_benchmark=false run.compile=false)
  device=(run.device=cpu)
  bench=(--quick)
else
  train_sizes=()
  device=(run.device=cuda)
  bench=(--gpu-only)
fi
# The CUDA tests alone (the CPU ones run in CI; here on a CPU they skip), not a CPU test whose
# parameter names a device (test_evaluate's mistakes: run.device='gpu'; 10 s of set-up)
test_select=(-k "(gpu or cuda) and not mistakes")
data_args=(data.dataset=npz "data.path=$data")
[ $dry = 1 ] && data_args=(data.dataset=synthetic data.synthetic_train=128 data.synthetic_test=64)  # 2 steps of 64

train() {  # train OUT_NAME ARGS...: ddp/train.py on the subset into $out/OUT_NAME (an earlier check's, replaced)
  local name=$1
  shift
  rm -rf "${out:?}/$name"
  "$py" ddp/train.py "${data_args[@]}" "run.out_dir=$out/$name" run.resume=never run.progress=false "$@"
}

ranks() {  # 2 and 3 ranks sharing the GPU with gloo, each killed after step 5 then resumed; 1 rank nccl
  local job=(data.dataset=synthetic data.synthetic_train=768 data.synthetic_test=101 model.name=small
    train.epochs=2 train.batch_size=48 run.save_every_steps=4 run.progress=false "${device[@]}")
  local n counts=(2 3)
  [ $dry = 1 ] && counts=(2)  # the CPU: one of them proves the commands (2: 14 s here, 3: 20 s)
  for n in "${counts[@]}"; do
    local dir="$out/ranks-$n" launch=("$py" -m torch.distributed.run --standalone --nproc_per_node=$n ddp/train.py)
    rm -rf "$dir"
    DDP_CIFAR_FAULT=step:5:r$((n - 1)) "${launch[@]}" "${job[@]}" run.backend=gloo "run.out_dir=$dir" &&
      { echo "rank $((n - 1)) was to be killed after step 5, and the run finished"; return 1; }
    DDP_CIFAR_FAULT=step:5:r$((n - 1)) "${launch[@]}" "${job[@]}" run.backend=gloo "run.out_dir=$dir" || return 1
    grep -q '"epoch": 2' "$dir/metrics.jsonl" || return 1
  done
  [ $dry = 1 ] && return 0  # no nccl on a CPU
  "$py" -m torch.distributed.run --standalone --nproc_per_node=1 ddp/train.py "${job[@]}" run.parallel=ddp \
    run.backend=nccl "run.out_dir=$out/ranks-1-nccl"  # DDP at 1 rank (auto would run it without DDP)
}

fsdp() {  # FSDP2 beside DDP, what each rank holds and images/s: 1 rank nccl, 2 ranks sharing the GPU with gloo
  local sizes=(--model resnet18 --batch 256 --steps 10)
  if [ $dry = 1 ]; then  # the CPU: 1 rank of the small net proves the commands (2 ranks: bench/results/fsdp-cpu.md)
    "$py" bench/fsdp_memory.py --model small --batch 32 --steps 1 --ranks 1 --out "$out/fsdp-1.md"
    return
  fi
  "$py" bench/fsdp_memory.py "${sizes[@]}" --ranks 1 --out "$out/fsdp-1-nccl.md" &&
    "$py" bench/fsdp_memory.py "${sizes[@]}" --ranks 2 --backend gloo --out "$out/fsdp-2-gloo.md"
}

step env bash -c "nvidia-smi || echo 'no nvidia-smi'; $py -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))'"
step tests "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_evaluate.py tests/test_sync_bn.py \
  "${test_select[@]}"
step bench "$py" -m bench "${bench[@]}" --out "$out"
step fast train fast --config configs/fast.yaml run.warmup_steps=3 "${train_sizes[@]}"
step resnet18 train resnet18 --config configs/resnet18.yaml "${train_sizes[@]}"
step ranks ranks
if wanted fsdp && ! "$py" -c 'from torch.distributed.fsdp import fully_shard' 2>/dev/null; then  # torch < 2.6
  version=$("$py" -c 'import torch; print(torch.__version__)')
  summary+=("| fsdp | skipped: run.parallel=fsdp needs torch >= 2.6 (FSDP2), this is $version | |")
else
  step fsdp fsdp
fi
if ! wanted airbench; then
  :
elif [ -n "$airbench" ]; then
  step airbench "$py" bench/airbench_subset.py --data "$data" --airbench "$airbench" --out "$out/airbench.json"
elif [ $dry = 1 ]; then
  summary+=("| airbench | skipped: no .gpu/airbench-*.tar.gz (make gpu-carry) | |")
else
  failed+=(airbench)
  summary+=("| airbench | FAILED: no .gpu/airbench-*.tar.gz; run make gpu-carry here and carry .gpu | |")
fi

lightning=(--workers 4)
[ $dry = 1 ] && lightning=(--workers 0 model.name=small "${train_sizes[@]}")
step lightning "$py" bench/lightning_fast.py "${data_args[@]}" --out "$out/lightning.json" "${lightning[@]}"

{
  echo "# make gpu-check$([ $dry = 1 ] && echo ' --dry-run (CPU, toy sizes)') — $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  printf '%s\n' "${summary[@]}"
  echo
  "$py" bench/gpu_summary.py "$out"
} >"$out/summary.md"
cat "$out/summary.md"
exit ${#failed[@]}
