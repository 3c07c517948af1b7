# make train: a short 2-process DDP run (one process per GPU where there are GPUs) on CIFAR-10.
#   make train DATA=path/to/cifar-dir-or-file.npz   uses a local copy instead of downloading.
# make test: the whole test suite (CPU, gloo). make bench: speed on this machine (python -m bench).
# All create .venv and install on first use.
SHELL := bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH):/usr/sbin:/sbin

# Quoted: a path with spaces in it ("My Drive/cifar.npz") is one argument.
QUOTED_DATA = '$(subst ','\'',$(DATA))'
ifneq ($(DATA),)
  ifeq ($(suffix $(lastword $(DATA))),.npz)
    DATA_ARGS := data.dataset=npz data.path=$(QUOTED_DATA)
  else
    DATA_ARGS := data.root=$(QUOTED_DATA) data.download=false
  endif
endif

.PHONY: install install-once venv system-packages train test bench lint format clean gpu-check gpu-carry gpu-lease
install: $(STAMP)

# --system-site-packages: a machine that already has torch + torchvision (a GPU VM with a torch that
# matches its driver) keeps them; elsewhere the pinned versions in constraints.txt are installed.
# pip's output (its resolver's notes on the system site's own packages among it) goes to
# .venv/pip.log and is shown only if the install fails.
# One make at a time installs (flock on .venv.lock, beside this Makefile, where there is flock: util-linux): two at
# once on a fresh clone (make train and make test in two terminals) ran two pips into one $(VENV), and one failed on
# the other's files. The second waits, then finds the install done.
FLOCK = $(shell command -v flock)
$(STAMP): pyproject.toml constraints.txt
	@$(if $(FLOCK),flock -n .venv.lock true || echo "another make is installing into $(VENV): waiting for it")
	@$(if $(FLOCK),flock .venv.lock) $(MAKE) --no-print-directory install-once

# make -n (a dry run) runs a line that names $(MAKE): this one says what it would do instead of installing
DRY_RUN = $(findstring n,$(firstword -$(MAKEFLAGS)))
install-once:
	@if [ -n "$(DRY_RUN)" ]; then echo "make -n: would install into $(VENV)"; exit 0; fi; \
	  if $(MAKE) -q $(STAMP); then echo "$(VENV): installed by another make meanwhile"; exit 0; fi; \
	  $(MAKE) --no-print-directory venv && echo "installing into $(VENV) (log: $(VENV)/pip.log)" && \
	  if $(PY) -c 'import torch, torchvision' 2>/dev/null; then pins=; else pins="-c constraints.txt"; fi && \
	  { $(PY) -m pip install $$pins -e '.[dev]' > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }; } && \
	  touch $(STAMP)

# $(VENV) with its pip. Where python3 has no ensurepip (Debian/Ubuntu without python3-venv) `python3 -m venv`
# fails after making $(VENV)/bin/python: a venv without pip, whose every later pip install failed ("No module
# named pip") until it was removed by hand. Its pip is added once ensurepip is there; until then, what to install.
NO_PIP := $(VENV) has no pip, and this Python no ensurepip to add it: on Debian/Ubuntu apt-get install \
  python3-venv (python3.X-venv for Python 3.X), then run make again
venv:
	@test -x $(PY) || python3 -m venv --system-site-packages $(VENV) || test -x $(PY)
	@$(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip --upgrade >/dev/null 2>&1 || \
	  { echo "error: $(NO_PIP)" >&2; exit 1; }

# The system packages of the SLURM and MPI launcher tests (installed as root on Debian/Ubuntu).
system-packages:
	@bash tests/system_packages.sh

train: $(STAMP)
	bash launch/torchrun.sh --config configs/quick.yaml $(DATA_ARGS) $(ARGS)

# TEST_WORKERS: pytest-xdist processes, whole test files each (--dist loadfile: a file's shared runs
# and the SLURM cluster stay in one), the longest files first (tests/conftest.py's LONGEST_FIRST; not
# xdist's own order, by number of tests); 0 runs the files one after another in pytest's own process.
TEST_WORKERS ?= 2
test: $(STAMP) lint system-packages
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# make bench [DATA=cifar10-subset.npz]: python -m bench on this machine, results in bench/results/.
bench: $(STAMP)
	$(PY) -m bench $(if $(DATA),--data $(QUOTED_DATA)) $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check ddp tests bench
	$(PY) -m ruff format --check ddp tests bench

format: $(STAMP)
	$(PY) -m ruff format ddp tests bench
	$(PY) -m ruff check --fix ddp tests bench

# The installed environment and caches only: never runs/ (checkpoints of hours of training) or data/.
clean:
	rm -rf $(VENV) .pytest_cache

# make gpu-check: every CUDA path run and measured on a GPU machine (bench/gpu_check.sh says what);
# needs nothing installed but torch (it runs from the checkout). make gpu-carry, here, first: the
# subset and airbench's source archive into .gpu/, the folder the device call carries.
gpu-check:
	bash bench/gpu_check.sh $(ARGS)

# make gpu-lease: gpu-check's steps (CHECK_STEPS), then the probes (bench/gpu_probe.sh), in one device call, their logs brought
# back packed in $$OUT/gpu-lease.tgz even when the call runs out of time (bench/gpu_lease.sh says how).
gpu-lease:
	bash bench/gpu_lease.sh $(ARGS)

gpu-carry:
	@mkdir -p .gpu
	cp ../shared/data/cifar10-subset.npz .gpu/
	python3 -m pip download -q --no-deps --no-binary :all: -d .gpu airbench==0.1.8
