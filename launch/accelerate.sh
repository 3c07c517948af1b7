#!/usr/bin/env bash
# accelerate launch, for machines set up with Hugging Face accelerate (pip install 'ddp-cifar[accelerate]').
#   bash launch/accelerate.sh --config configs/quick.yaml
# It runs as `python ddp/accelerate_launch.py` (accelerate launch's own code, the same arguments): a stop (Ctrl-C)
# or a failed rank ends it with an exit code after the ranks' lines, not accelerate's traceback.
# One machine with GPUs: launch/accelerate/one-machine.yaml, one process per GPU (NPROC to override).
# No GPU: accelerate's CPU mode, NPROC (default 2) processes through mpirun (needs Open MPI or MPICH).
#   Without MPI, `accelerate launch --multi_gpu --num_processes 2 ddp/train.py` also runs 2 processes on
#   a machine without GPUs: it starts torchrun, and the ranks use the CPU with gloo.
# Several machines: run on each with ACCELERATE_CONFIG=launch/accelerate/multi-machine.yaml,
#   NUM_MACHINES, MACHINE_RANK (0 on MASTER_ADDR), MASTER_ADDR, MASTER_PORT; NPROC per machine.
# MASTER_PORT: unless set, a free port on one machine (as torchrun --standalone takes one: two runs at once here
# do not meet; the second one's ranks found the first's port taken), 29500 on several. Every argument is passed
# through to ddp/train.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/launch/common.sh"
python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("accelerate") is None)' ||
  { echo "error: no accelerate in this python ($(command -v python)): pip install 'ddp-cifar[accelerate]'" \
    "(or use launch/torchrun.sh)" >&2; exit 2; }
gpus=$(gpu_count)
if [ -n "${MASTER_PORT:-}" ] || [ -n "${ACCELERATE_CONFIG:-}" ]; then
  port=${MASTER_PORT:-29500}
else
  port=$(python -c 'import sys; sys.path.insert(0, sys.argv[1]); from ddp import network; print(network.free_port())' \
    "$root")
fi
[[ $port =~ ^[1-9][0-9]*$ ]] && ((port <= 65535)) ||
  { echo "error: MASTER_PORT=$port is not a port number (1-65535)" >&2; exit 2; }
machines=1
nproc=${NPROC:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}  # per machine
omp_threads "$nproc"
if [ -n "${ACCELERATE_CONFIG:-}" ]; then
  [ -f "$ACCELERATE_CONFIG" ] || { echo "error: ACCELERATE_CONFIG=$ACCELERATE_CONFIG: no such file" \
    "(launch/accelerate/multi-machine.yaml is one)" >&2; exit 2; }
  machines=${NUM_MACHINES:?set NUM_MACHINES}
  machines NUM_MACHINES "$machines" MACHINE_RANK "${MACHINE_RANK:?set MACHINE_RANK}"
  cmd=(python "$root/ddp/accelerate_launch.py" --config_file "$ACCELERATE_CONFIG" --num_machines "$machines"
    --machine_rank "$MACHINE_RANK" --main_process_ip "${MASTER_ADDR:?set MASTER_ADDR}"
    --main_process_port "$port" --num_processes $((machines * nproc)))
elif [ "$gpus" -gt 0 ]; then
  cmd=(python "$root/ddp/accelerate_launch.py" --config_file "$root/launch/accelerate/one-machine.yaml"
    --num_processes "$nproc" --main_process_port "$port")
else
  command -v mpirun >/dev/null || {
    echo "launch/accelerate.sh: no GPU, and accelerate runs several CPU processes only through mpirun:" \
      "install Open MPI (apt-get install openmpi-bin), or use accelerate launch --multi_gpu (torchrun," \
      "CPU processes too) or launch/torchrun.sh" >&2
    exit 2
  }
  if [ "$(id -u)" = 0 ]; then  # Open MPI refuses root unless told twice (containers often run as root)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  hostfile=mpirun-localhost  # Open MPI's form; MPICH's Hydra refused it (told apart as accelerate does)
  mpirun --version 2>/dev/null | grep -q "Open MPI" || hostfile=mpich-localhost
  cmd=(python "$root/ddp/accelerate_launch.py" --cpu --num_processes "$nproc" --num_machines 1 --mixed_precision no
    --dynamo_backend no --mpirun_hostfile "$root/launch/accelerate/$hostfile" --main_process_port "$port")
fi
# accelerate's machine is MACHINE_RANK's: a NODE_RANK left in the shell (by launch/multinode.sh, say) made the
# preflight take this for a machine of several, and wait for MASTER_ADDR to answer
unset NODE_RANK
if [ "${MACHINE_RANK:-0}" = 0 ]; then  # once, on the first machine; the lock is rank 0's
  preflight $((machines * nproc)) "$@"
fi
cmd+=("$root/ddp/train.py" "$@")
shown "${cmd[@]}" >&2
exec "${cmd[@]}"  # this script's pid the launcher's: a kill of it stops the run (it killed this shell alone)
