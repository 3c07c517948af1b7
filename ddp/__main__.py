"""`python -m ddp`: which commands ddp-cifar has, one line each; each runs as its own `python -m ddp.NAME`
(train as ddp/train.py, under a launcher for several processes). Exit 0, also with -h/--help (each command listed
takes it, so a user types it here too); 2 with other arguments (nothing runs)."""

import sys

COMMANDS = """\
ddp-cifar's commands (each with --help):
  python ddp/train.py [--config FILE.yaml] [section.key=value ...]   train: one process (CPU, one GPU, DataParallel)
  torchrun --nproc_per_node=N ddp/train.py ...                       train with DDP, N processes (launch/*.sh too)
  python -m ddp.evaluate --checkpoint PATH                           accuracy, per-class table, confusion matrix
  python -m ddp.checkpoint inspect PATH | export PATH OUT            what a checkpoint holds; its model weights alone
  python -m ddp.plot RUN_DIR [RUN_DIR ...]                           PNG charts of runs' metrics.jsonl
  python -m ddp.doctor [--config FILE.yaml] [section.key=value ...]  check a machine and a launch before training"""


def main(argv: list[str]) -> int:
    if argv and argv not in (["-h"], ["--help"]):
        print(f"error: python -m ddp takes no arguments (it lists the commands); got {' '.join(argv)}\n{COMMANDS}",
              file=sys.stderr)  # fmt: skip
        return 2
    print(COMMANDS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
