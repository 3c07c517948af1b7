# Sourced by the launch scripts in launch/ and slurm/: what they share. Needs $root (the repository).

# omp_threads N [CORES]: OMP_NUM_THREADS for N processes on this machine (NPROC, checked here), unless
# it is set: the CPUs this shell may use (or CORES) / N, at least 1: its affinity, and its cgroup's CPU quota (a
# container's --cpus, Kubernetes' limits.cpu: ddp/cpus.py), which getconf does not see. Gives CPU runs the right
# thread count, and silences torchrun's warning that it set it to 1. One set that OpenMP refuses (abc, 0) was
# libgomp's warning from every rank, each then taking torch's default, all the CPUs: refused here, with NPROC's.
omp_threads() {
  [[ $1 =~ ^[1-9][0-9]*$ ]] ||
    { echo "error: NPROC=$1 must be a whole number, 1 or more (processes on this machine)" >&2; exit 2; }
  [[ -z ${OMP_NUM_THREADS:-} || $OMP_NUM_THREADS =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
    { echo "error: OMP_NUM_THREADS=$OMP_NUM_THREADS must be a whole number, 1 or more (threads per process)," \
      "or unset (each process then takes its share of this machine's CPUs)" >&2; exit 2; }
  local cores=${2:-$(python -c 'import sys; sys.path.insert(0, sys.argv[1]); from ddp import cpus; print(cpus.usable())' \
    "$root" 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores / $1 > 0 ? cores / $1 : 1))}
}

# shown COMMAND...: "+ COMMAND" as one line a shell reads back as it ran: a word with a space, a quote or another
# character the shell reads is in single quotes (run.out_dir='runs/my run'), the others as they are.
shown() {
  local words=() word plain='^[A-Za-z0-9_./:=,@%+-]+$' quote="'" escaped="'\\''"  # (in variables: bash 3.2 too)
  for word in "$@"; do
    if [[ $word =~ $plain ]]; then words+=("$word"); else words+=("'${word//$quote/$escaped}'"); fi
  done
  echo "+ ${words[*]}"
}

# whole NAME VALUE [WHAT]: VALUE is a whole number (0, 1, 2, ... as written by hand: no sign, no leading
# zero, which bash's arithmetic would read as octal), else one line naming NAME, and exit 2.
whole() { [[ $2 =~ ^(0|[1-9][0-9]*)$ ]] || { echo "error: $1=$2 must be a whole number${3:+ ($3)}" >&2; exit 2; }; }

# machines COUNT_NAME COUNT RANK_NAME RANK: how many machines and which one this is (NNODES and NODE_RANK,
# NUM_MACHINES and MACHINE_RANK): COUNT >= 1 and RANK 0 to COUNT-1, else one line, and exit 2.
machines() {
  whole "$1" "$2" && whole "$3" "$4" "0 to $1-1"
  (($2 >= 1)) || { echo "error: $1=$2 must be 1 or more (how many machines)" >&2; exit 2; }
  (($4 < $2)) || { echo "error: $3=$4 must be 0 to $1-1=$(($2 - 1))" >&2; exit 2; }
}

# endpoint HOST PORT: HOST:PORT as torchrun's --rdzv_endpoint takes it, an IPv6 address in brackets ([fd00::1]:29400;
# HOST may have them already). torchrun reads fd00::1:29400 right, and fd00::1 alone as host fd00: port 1.
endpoint() {
  local host=${1#[}
  host=${host%]}
  if [[ $host == *:* ]]; then echo "[$host]:$2"; else echo "$host:$2"; fi
}

# gpu_count: the GPUs torch sees here. A machine with no GPU driver (no /dev/nvidia*, /dev/kfd, nvidia-smi
# or rocm-smi) answers 0 at once instead of paying a torch import (2 s on a laptop CPU) to learn it.
gpu_count() {
  if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [ -e /dev/kfd ] || command -v nvidia-smi >/dev/null ||
    command -v rocm-smi >/dev/null; then
    python -c 'import torch; print(torch.cuda.device_count())'
  else
    echo 0
  fi
}

# gpu_count_or_2: the GPUs torch sees here, or 2 (CPU processes) without any.
gpu_count_or_2() {
  local n
  n=$(gpu_count)
  echo $((n > 0 ? n : 2))
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
