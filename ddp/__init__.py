"""ddp-cifar: one training loop for CIFAR on a CPU, one GPU, DataParallel and DDP.

Its modules in layers, top to bottom. A module imports only modules after it in this list, never one
before it (tests/test_layers.py), so each can be read knowing only what is below it:

    the launcher        accelerate_launch, torchrun, torchrun_args, pausing
    the loop            train
    commands            __main__, evaluate, doctor, plot
    a run's state       warmup, profiling, preemption, logs, checkpoint, compatible, schema, weights, faults, rundir,
                        metrics
    data and the step   checks, alike, graphed, loaders, datasets, cifar, mixing, optim, muon
    the process group   distributed, fsdp, lifeline, lost_rank
    who runs where      devices, cli, startup, launchers, requeue, config, config_file
    the ground          models, sync_bn, ema, network, files, cpus, processes, rng, errors
"""

import sys

__version__ = "0.1.0"

if sys.platform == "win32":  # (its stop signals, launchers and files are POSIX's: a traceback of a missing module)
    sys.stderr.write("error: ddp-cifar needs a POSIX system (Linux, macOS): on Windows, run it in WSL2\n")
    raise SystemExit(2)
