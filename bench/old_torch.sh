#!/usr/bin/env bash
# The test suite under another torch than constraints.txt's: pyproject promises torch >= 2.4, and a cluster's
# module system or an older GPU VM image may have it. Builds a venv of that torch (PyPI's build, which runs on a
# CPU) and its torchvision beside the checkout, then runs `pytest` with it on this checkout, as `make test` does.
#   bash bench/old_torch.sh [TORCH TORCHVISION]    (default 2.4.1 0.19.1; the venv: $OLD_TORCH_VENV,
#                                                  default /tmp/ddp-cifar-torch-TORCH; PYTEST_ARGS as in make test)
# About 3 GB of downloads the first time. What failed with 2.4.1 and why: bench/results/torch-2.4-cpu.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
torch=${1:-2.4.1}
vision=${2:-0.19.1}
[[ $torch =~ ^2\.[0-9]+\.[0-9]+$ && $vision =~ ^0\.[0-9]+\.[0-9]+$ ]] || {
  echo "old_torch.sh: TORCH and TORCHVISION are versions such as 2.4.1 0.19.1, not '$torch' '$vision'" >&2
  exit 64
}
venv=${OLD_TORCH_VENV:-/tmp/ddp-cifar-torch-$torch}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch')"; then
  python3 -m venv "$venv"
  printf 'torch==%s\ntorchvision==%s\n' "$torch" "$vision" > "$venv/pins.txt"
  # the test tools and optional packages the suite uses, at versions that accept this torch (the pins keep it)
  "$venv/bin/pip" install -q -c "$venv/pins.txt" "torch==$torch" "torchvision==$vision" "numpy<2.3" pyyaml tqdm \
    pytest pytest-xdist psutil accelerate matplotlib tensorboard lightning "airbench==0.1.8" ruff > "$venv/pip.log" 2>&1 ||
    { tail -20 "$venv/pip.log"; exit 1; }
  "$venv/bin/pip" install -q --no-deps -e "$root" >> "$venv/pip.log" 2>&1
fi
cd "$root"
"$venv/bin/python" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
exec "$venv/bin/python" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -p no:cacheprovider -rf ${PYTEST_ARGS:-}
