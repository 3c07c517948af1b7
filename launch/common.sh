# Sourced by the launch scripts in launch/ and slurm/: what they share. Needs $root (the repository).

# omp_threads N [CORES]: OMP_NUM_THREADS for N processes on this machine (NPROC, checked here), unless
# it is set: its cores (or CORES) / N, at least 1. Gives CPU runs the right thread count, and silences
# torchrun's warning that it set it to 1.
omp_threads() {
  [[ $1 =~ ^[1-9][0-9]*$ ]] ||
    { echo "error: NPROC=$1 must be a whole number, 1 or more (processes on this machine)" >&2; exit 2; }
  local cores=${2:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores / $1 > 0 ? cores / $1 : 1))}
}

# gpu_count_or_2: the GPUs torch sees here, or 2 (CPU processes) without any. A machine with no GPU
# driver (no /dev/nvidia*, /dev/kfd, nvidia-smi or rocm-smi) answers 2 at once instead of paying a
# torch import (2 s on a laptop CPU) to learn that it has none.
gpu_count_or_2() {
  if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [ -e /dev/kfd ] || command -v nvidia-smi >/dev/null ||
    command -v rocm-smi >/dev/null; then
    python -c 'import torch; print(torch.cuda.device_count() or 2)'
  else
    echo 2
  fi
}

# preflight N ARGS...: ddp/train.py --preflight N ARGS, before the launcher starts N processes. A
# mistake every rank would make (the config, the global batch, the data, run.out_dir) is then one
# line and exit 2, here, instead of one error per rank and the launcher's traceback. (launch/torchrun.sh
# and multinode.sh have ddp/torchrun.py --preflight=N make it in its own process: one Python start fewer.)
preflight() {
  local n=$1
  shift
  case " $* " in *" --help "* | *" -h "* | *" --print-config "*) # answered here once, not by every rank
    python "$root/ddp/train.py" "$@"
    exit $? ;;
  esac
  python "$root/ddp/train.py" --preflight "$n" "$@" || exit $?
}
