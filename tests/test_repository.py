"""The repository itself: nothing at its root but the known top-level entries (no committed debug
output, logs or data), and no module of the package that a reader cannot take in at once."""

import ast
import fnmatch
import os
import shlex
import subprocess
import sys
import time

import pytest
from conftest import REPO, clean_env, ok

TOP_LEVEL = {
    ".ci", ".gitignore", "Makefile", "README.md", "bench", "configs", "constraints.txt", "ddp", "launch",
    "pyproject.toml", "slurm", "tests",
}  # fmt: skip


def root_entries() -> set[str]:
    """The top-level names of every file git tracks or would add (untracked, not ignored); outside a
    git checkout, the directory's entries that .gitignore does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    )
    if listed.returncode == 0:
        return {path.split("/")[0] for path in listed.stdout.splitlines()}
    ignored = [p.strip().rstrip("/") for p in (REPO / ".gitignore").read_text().splitlines() if p.strip()]
    names = {p.name for p in REPO.iterdir() if p.name != ".git"}
    return {n for n in names if not any(fnmatch.fnmatch(n, pattern) for pattern in ignored)}


def test_the_root_holds_only_the_known_top_level_entries():
    unknown = sorted(root_entries() - TOP_LEVEL)
    assert not unknown, f"unexpected at the repository root (debug output? data?): {unknown}"


def test_package_modules_and_functions_stay_small():
    """../shared/STYLE.md: no module of ddp/ over 400 lines, no function over 60."""
    for path in sorted((REPO / "ddp").glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 400, f"{path.name} has {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{path.name}:{node.name} has {length} lines"


def test_each_module_says_what_it_owns_in_at_most_three_lines():
    """ddp/: every module opens with a docstring whose first paragraph (what it owns) is 1-3 lines."""
    for path in sorted((REPO / "ddp").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc, f"{path.name} has no docstring"
        assert len(doc.split("\n\n")[0].splitlines()) <= 3, f"{path.name}: what it owns, in more than 3 lines"


def test_make_clean_removes_the_environment_not_a_users_runs_or_data():
    """`make clean` removed runs/ with .venv: a user cleaning the install lost every checkpoint of make train."""
    made = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VENV")  # a make test VENV=...'s (make exports VENV): not its own
    own = {k: v for k, v in os.environ.items() if k not in made}
    planned = subprocess.run(["make", "-n", "clean"], cwd=REPO, env=own, capture_output=True, text=True, check=True)
    planned = planned.stdout
    removed = {word for line in planned.splitlines() if line.startswith("rm ") for word in line.split()[2:]}
    assert removed == {".venv", ".pytest_cache"}, planned


@pytest.mark.parametrize("data, args", [("My Drive/it's.npz", ["data.dataset=npz", "data.path=My Drive/it's.npz"]),
                                        ("my data", ["data.root=my data", "data.download=false"])])  # fmt: skip
def test_make_train_passes_a_data_path_with_spaces_or_quotes_as_one_argument(data, args):
    """`make train DATA="My Drive/cifar.npz"` gave data.path=My and a stray Drive/cifar.npz (a usage error)."""
    make = ["make", "--no-print-directory", "-n", "train", f"DATA={data}"]  # under make test, a sub-make
    planned = subprocess.run(make, cwd=REPO, capture_output=True, text=True, check=True).stdout
    line = next(line for line in planned.splitlines() if line.startswith("bash launch/torchrun.sh"))
    assert shlex.split(line)[-len(args) :] == args, planned


def test_a_venv_left_without_pip_gets_its_pip_or_says_what_to_install(tmp_path):
    """Debian/Ubuntu without python3-venv: `python3 -m venv` makes .venv/bin/python, then fails for want of
    ensurepip. Every later make ran pip in that venv ("No module named pip") until .venv was removed by hand.
    `make venv`, make install's first step, now adds its pip once ensurepip is there, and says what to install
    while it is not (an ensurepip that fails, first on PYTHONPATH, stands for the missing one)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shadow = tmp_path / "shadow" / "ensurepip"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (shadow / "__main__.py").write_text("raise SystemExit('No module named ensurepip')\n")
    make = ["make", "--no-print-directory", "venv", f"VENV={venv}"]
    without = clean_env(PYTHONPATH=str(shadow.parent))
    missing = subprocess.run(make, cwd=REPO, env=without, capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.splitlines()[0] == (
        f"error: {venv} has no pip, and this Python no ensurepip to add it: on Debian/Ubuntu apt-get install "
        "python3-venv (python3.X-venv for Python 3.X), then run make again"
    )
    ok(subprocess.run(make, cwd=REPO, env=clean_env(), capture_output=True, text=True))
    ok(subprocess.run([venv / "bin" / "python", "-m", "pip", "--version"], capture_output=True, text=True))


def test_two_makes_at_once_install_once_and_the_second_waits_for_the_first(tmp_path):
    """`make train` and `make test` in two terminals of a fresh clone: both ran pip into one .venv, and one failed
    on the other's half-written files (`No such file or directory: .../idna-3.20.dist-info/INSTALLER....tmp`, seen
    here). Now one installs and the other waits and finds it done; where the first install fails, the second does
    it. A stand-in python (pip's install: a second, logged) keeps it to seconds."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"""#!/bin/sh
case "$*" in *"pip install"*)
  echo "$*" >> {log}; sleep 1
  if [ -e {tmp_path / "fail"} ]; then rm {tmp_path / "fail"}; exit 1; fi;;
esac
""")
    python.chmod(0o755)
    env = {k: v for k, v in clean_env().items() if not k.startswith("MAKE")}  # (not make test's own make)
    make = ["make", "--no-print-directory", "install", f"VENV={venv}"]

    def twice() -> tuple[list[int], list[str]]:
        first = subprocess.Popen(make, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not log.exists() and first.poll() is None and time.monotonic() < deadline:  # its pip: under the lock
            time.sleep(0.02)
        second = subprocess.run(make, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        said = first.communicate(timeout=60)[0]
        return [first.returncode, second.returncode], [said, second.stdout]

    codes, said = twice()
    assert log.read_text().count("pip install") == 1 and codes == [0, 0], said
    assert said[0] == f"installing into {venv} (log: {venv}/pip.log)\n", said
    assert said[1] == (f"another make is installing into {venv}: waiting for it\n"
                       f"{venv}: installed by another make meanwhile\n"), said  # fmt: skip
    (venv / ".installed").unlink()
    log.unlink()
    (tmp_path / "fail").touch()  # the first's pip fails: the second installs
    codes, said = twice()
    assert log.read_text().count("pip install") == 2 and codes == [2, 0] and (venv / ".installed").exists(), said
