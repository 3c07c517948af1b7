#!/usr/bin/env bash
# Threads against a cgroup's CPU quota (Docker's --cpus, Kubernetes' limits.cpu): img/s of a plain
# `python ddp/train.py` (fast at model.width=0.25, synthetic data, 2 epochs; the second epoch's figure) in a cgroup
# of each quota, with as many threads as the machine has cores (torch's default, which does not see the quota) and
# with none said (OMP_NUM_THREADS unset: ddp/cpus.py's share). Root: it makes the cgroups (v2, or v1's cpu).
#   sudo bash bench/cpu_quota.sh [QUOTA ...]      (default: 0.5 1)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
cores=$(nproc)
base=/sys/fs/cgroup
[ -f $base/cgroup.controllers ] || base=$base/cpu
echo "| quota (CPUs) | threads | img/s, epoch 2 |"
echo "| ---: | --- | ---: |"
for quota in "${@:-0.5 1}"; do
  for threads in "$cores" ""; do
    group=$base/ddp-cifar-bench-$$
    mkdir "$group"
    q=$(python3 -c "print(int($quota * 100000))")
    if [ -f "$group/cpu.max" ]; then echo "$q 100000" >"$group/cpu.max"; else echo "$q" >"$group/cpu.cfs_quota_us"; fi
    out=$(mktemp -d)
    line=$(sh -c "echo \$\$ > $group/cgroup.procs; ${threads:+OMP_NUM_THREADS=$threads} exec $python $root/ddp/train.py \
      data.dataset=synthetic data.synthetic_train=2048 data.synthetic_test=256 model.name=fast model.width=0.25 \
      train.batch_size=64 train.epochs=2 run.out_dir=$out" 2>&1)
    rm -rf "$out"
    rmdir "$group"
    took=$(grep -o 'threads=[0-9]*' <<<"$line")
    speed=$(grep '^epoch 2/2' <<<"$line" | grep -o '[0-9]* img/s')
    echo "| $quota | ${threads:-unset}: ${took} | ${speed% img/s} |"
  done
done
