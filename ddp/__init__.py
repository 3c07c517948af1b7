"""ddp-cifar: one training loop for CIFAR on a CPU, one GPU, DataParallel and DDP."""

__version__ = "0.1.0"
