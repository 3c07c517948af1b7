"""ddp-cifar's benchmarks, outside the package: `python -m bench` (make bench) and
`python bench/checkpoint_io.py`. Results: bench/results/."""
