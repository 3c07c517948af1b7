#!/usr/bin/env bash
#SBATCH --job-name=ddp-cifar
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=TERM@120
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out
# DDP under SLURM: srun starts one torchrun per node; each starts one process per GPU of its node.
# Submit from the repository root (the job runs there); every argument goes to ddp/train.py:
#   sbatch slurm/train.sh --config configs/quick.yaml
#   sbatch --nodes=4 --gpus-per-node=4 --time=12:00:00 slurm/train.sh --config configs/resnet18.yaml
# - Rendezvous: c10d on the first node of the job, port derived from the job id (ddp/launchers.py:
#   slurm_rendezvous), so concurrent jobs do not collide.
# - Processes per node: NPROC, else the GPUs SLURM allocated on the node (SLURM_GPUS_ON_NODE), else
#   the GPUs torch sees, else 2 CPU processes (gloo); OMP_NUM_THREADS: the node's cores / processes.
# - Before srun, one preflight on the first node (ddp/train.py --preflight): config, data, out_dir.
# - out_dir: $OUT_ROOT/slurm-<job id> (OUT_ROOT defaults to runs; for array jobs <job>_<task>), on a
#   filesystem every node sees. A run.out_dir=... argument overrides it.
# - Preemption: 120 s before the time limit (--signal=TERM@120), or when SLURM preempts the job, every
#   process gets SIGTERM: all ranks stop at the next step boundary, rank 0 saves a checkpoint and
#   requeues the job (scontrol requeue); the requeued job resumes from that checkpoint in the same
#   out_dir; one in the job's start-up (nothing to save) ends its step: this shell requeues the job then (not one
#   scancel ended), and before srun one SLURM preempts already (no step to signal yet). --open-mode=append keeps the
#   log of every run in one file. A signal for this shell (B:TERM, scancel -b) it sends on to the steps, the same stop
#   (before srun: the job is requeued, not started); not scancel --full's SIGTERM, which srun has too: it ends the job.
set -euo pipefail
# A stop signal for this shell before srun (scancel -b, --signal=B:TERM@120 in the preflight: bash takes it once the
# command it waits for ends) is noted, and the job requeued before srun instead of started (ddp/requeue.py).
stop_seen=
for sig in TERM INT HUP USR1 USR2; do
  trap "stop_seen=SIG$sig" "$sig"
done
root=${DDP_CIFAR_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}
if [ ! -f "$root/ddp/train.py" ]; then
  echo "slurm/train.sh: no ddp/train.py in $root: submit from the repository root or set DDP_CIFAR_ROOT" >&2
  exit 2
fi
cd "$root"
job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
job=${job:-${SLURM_JOB_ID:?not inside a SLURM job: submit with sbatch slurm/train.sh}}
rendezvous=$(python -c '
import sys
from ddp import errors, launchers
try:
    print(*launchers.slurm_rendezvous())
except errors.UsageError as e:  # MASTER_PORT that is no port, say: one line, not a traceback
    print(f"error: {e}", file=sys.stderr)
    sys.exit(errors.EXIT_USAGE)') || exit $?
read -r addr port <<<"$rendezvous"
source "$root/launch/common.sh"
nproc=${NPROC:-${SLURM_GPUS_ON_NODE:-0}}
if [ "$nproc" = 0 ]; then
  nproc=$(gpu_count_or_2)
fi
omp_threads "$nproc" "${SLURM_CPUS_ON_NODE:-}"  # the cores SLURM gave this node, shared by its processes
# on the first node, which serves the rendezvous: also whether $port is free there
MASTER_ADDR=$addr MASTER_PORT=$port NODE_RANK=0 preflight $((SLURM_JOB_NUM_NODES * nproc)) \
  run.out_dir="${OUT_ROOT:-runs}/slurm-$job" "$@"
echo "job $job (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES} node(s) [$SLURM_JOB_NODELIST]," \
  "$nproc process(es) per node, rendezvous $addr:$port"
cmd=(srun --ntasks-per-node=1 --kill-on-bad-exit=1
  python ddp/torchrun.py --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$nproc" --rdzv_backend=c10d
  --rdzv_endpoint="$(endpoint "$addr" "$port")" --rdzv_id="$job"
  ddp/train.py run.out_dir="${OUT_ROOT:-runs}/slurm-$job" "$@")
# SLURM's preemption in the start-up above (the rendezvous port, the preflight) signalled the job's steps, none yet:
# lost, the job trained on through its GraceTime, until SLURM killed it. It is requeued here instead, as is one this
# shell was signalled to stop (ddp/requeue.py).
python -c 'import sys; from ddp import requeue; sys.exit(requeue.main(sys.argv[1:]))' before "$job" "$stop_seen" ||
  exit $?
shown "${cmd[@]}"
# srun runs as this shell's child, not in its place: srun takes SIGTERM (SIGHUP, SIGQUIT) as the job's end and kills
# its tasks, so a SIGTERM for this shell (#SBATCH --signal=B:TERM@120, scancel -b) ended the job at once, FAILED,
# without a checkpoint. The signals this shell gets go to the job's steps instead (scancel --signal: the ranks, and
# their torchrun; not this shell again), where a stop signal stops every rank with its checkpoint, as SLURM's own do.
for sig in TERM INT HUP USR1 USR2; do
  trap "signalled=1 stop_seen=SIG$sig; scancel --signal=$sig \"\$SLURM_JOB_ID\" 2>/dev/null || true" "$sig"
done
"${cmd[@]}" &
step=$!
while :; do  # until srun ends: a signal's trap ends the wait (its status then > 128), not srun
  signalled=
  wait "$step" && code=0 || code=$?
  [ -n "$signalled" ] && [ "$code" -gt 128 ] || break
done
# A stop signal before training (SLURM's preemption and time limit signal the steps alone; scancel -b, sent on) ends
# the step with nothing to save and no rank to requeue the job: FAILED. This shell requeues it then (ddp/requeue.py),
# unless the job is no longer RUNNING (rank 0 requeued it, scancel ended it: both signal this shell too).
python -c 'import sys; from ddp import requeue; sys.exit(requeue.main(sys.argv[1:]))' \
  after "$job" "$code" "$stop_seen" || true
exit "$code"
