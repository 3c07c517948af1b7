"""How often a 2-rank gloo job fails to leave its process group: tests/test_ddp_knobs.py's job (tests/knob_worker.py,
seven DDP probes in one group, ending in an all_gather_object), run again and again, several at a time, under
the torch of the given Python (bench/old_torch.sh's venv for torch 2.4.1).

    python bench/group_exits.py [--python /tmp/ddp-cifar-torch-2.4.1/bin/python] [--runs 30] [--at-once 3]

torch before 2.8 destroyed a gloo group holding the interpreter lock while a worker thread of the group could still
need it (ddp/distributed.py: GLOO_PAUSE_S). A job still running after 45 s is hung: py-spy (where that Python has
it) dumps each rank's native stack into the temporary folder, and ddp's backstop ends the rank at 75 s (exit 1).
Prints one line per job (index, exit code, seconds) and the count of each exit code.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HUNG_S = 45.0


def one_job(python: Path, folder: Path, index: int) -> tuple[int, int, float]:
    """(index, exit code, seconds) of one torchrun job; native stacks of its ranks in `folder` if it hangs."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    worker = [str(REPO / "tests" / "knob_worker.py"), str(folder / f"report{index}.json")]  # its own PROBES
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *worker]
    start, dumped = time.monotonic(), False
    with open(folder / f"job{index}.log", "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while job.poll() is None:
            time.sleep(1.0)
            if not dumped and time.monotonic() - start > HUNG_S and (spy := python.parent / "py-spy").exists():
                dumped = True
                ranks = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
                for pid in ranks:
                    stack = subprocess.run([str(spy), "dump", "--native", "--pid", pid], capture_output=True, text=True)
                    (folder / f"job{index}-rank-pid{pid}.txt").write_text(stack.stdout + stack.stderr)
    return index, job.returncode, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", type=Path, default=Path(sys.executable), help="the Python (and torch) to run")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--at-once", type=int, default=3)
    args = parser.parse_args()
    if args.runs < 1 or args.at_once < 1:
        parser.error("--runs and --at-once are 1 or more")
    if not args.python.is_file():
        parser.error(f"--python {args.python}: no such file")
    folder = Path(tempfile.mkdtemp(prefix="group-exits-"))
    print(f"logs and stacks in {folder}", flush=True)
    codes: collections.Counter[int] = collections.Counter()
    with concurrent.futures.ThreadPoolExecutor(args.at_once) as pool:
        for index, code, seconds in pool.map(lambda i: one_job(args.python, folder, i), range(args.runs)):
            codes[code] += 1
            print(f"{index} exit {code} {seconds:.1f} s", flush=True)
    print("exit codes:", ", ".join(f"{code}: {n}" for code, n in sorted(codes.items())))


if __name__ == "__main__":
    main()
