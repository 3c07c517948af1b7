"""Runs ddp/train.py's main under torchrun, then reports the threads left in the process.

    torchrun --standalone --nproc_per_node=2 tests/group_worker.py OUT_DIR [overrides]

Each rank writes OUT_DIR/threads-<rank>.json: the names of its threads once main has returned. A
process group that outlives destroy_process_group keeps its gloo threads ("pt_gloo_runloop",
"gloo_tcp_loop"), and they can abort the interpreter's exit."""

import json
import os
import sys
import time
from pathlib import Path

from ddp import train


def thread_names() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that has just exited
            pass
    return sorted(names)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    train.main([f"run.out_dir={out}", *sys.argv[2:]])
    deadline = time.monotonic() + 2  # threads that are on their way out get a moment
    while any(n.startswith(("pt_gloo", "gloo")) for n in thread_names()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (out / f"threads-{os.environ['RANK']}.json").write_text(json.dumps(thread_names()))
