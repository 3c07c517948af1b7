"""A command's start, before its seconds of imports (torch's): what would end it in a traceback there is one line
instead (quiet_startup), said by one process per machine. No torch here: it runs before torch's import.
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import sys
import traceback
from collections.abc import Mapping
from difflib import get_close_matches
from types import TracebackType

from ddp.errors import EXIT_USAGE, INTERRUPTED, first_line, interrupted, remember_interrupts, standard_streams
from ddp.launchers import launched, speaks_for_its_machine
from ddp.processes import first_for_the_oom_killer

SCRIPTS = {"ddp-train": "ddp.train"}  # pyproject.toml's console scripts: the module each imports as its command
DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")  # TORCH_DISTRIBUTED_DEBUG's, in any case (torch's own reading of it)
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the caching allocator's settings (and the newer name)
ALLOC_CONF_EXAMPLE = "e.g. expandable_segments:True,max_split_size_mb:128"


def torch_environment_refused(env: Mapping[str, str] = os.environ) -> str | None:
    """The line for an environment variable that torch's import itself refuses, in a traceback or an abort; None for
    none: TORCH_DISTRIBUTED_DEBUG other than OFF, INFO or DETAIL ("" too, as `export TORCH_DISTRIBUTED_DEBUG=` leaves
    it), read as torch.distributed loads, which `import torch` does; an allocator setting torch cannot split into
    options (allocator_conf_broken)."""
    level = env.get("TORCH_DISTRIBUTED_DEBUG")
    if level is not None and level.upper() not in DEBUG_LEVELS:
        return f"error: TORCH_DISTRIBUTED_DEBUG={level!r}: torch takes {', '.join(DEBUG_LEVELS)}; set one, or unset it"
    for name in ALLOC_CONF:
        if name in env and (why := allocator_conf_broken(env[name])):
            why += f"; torch takes comma-separated key:value options ({ALLOC_CONF_EXAMPLE})"
            return f"error: {name}={env[name]!r}: {why}; a CUDA torch aborts on it as it loads: fix it, or unset it"
    return None


def allocator_conf_broken(value: str) -> str | None:
    """Why torch's tokenizer of PYTORCH_CUDA_ALLOC_CONF (and PYTORCH_ALLOC_CONF) runs out of `value`, None where it
    does not: a CUDA build of torch (2.14.1 here) reads it as libc10_cuda.so loads, in `import torch`, on a CPU too,
    and an option without its value (`garbage`, `max_split_size_mb=128`, `a:b c:d` with a space for the comma: read
    as `a:bc`, then `:d` without a key) ended the process in a C++ abort, exit 134, 40 frames under "INTERNAL ASSERT
    FAILED ... please report a bug to PyTorch". The tokens are torch's (`,` `:` `[` `]` each one, whitespace
    dropped); each option is a key, a separator, then a value or a `[...]` list, then one token between options. The
    keys and values themselves are torch's to check, at its first CUDA use."""
    tokens = re.findall(r"[,:\[\]]|[^,:\[\]]+", re.sub(r"[ \t\n\v\f\r]+", "", value))
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if i + 2 >= len(tokens):  # (a space between two letters: two words made one)
            spaces = " (torch drops spaces: commas part options)" * bool(re.search(r"[^,:\[\]\s]\s+[^,:\[\]\s]", value))
            return f"option {key!r} has no value after it{spaces}"
        i += 2
        if tokens[i] == "[":
            if "]" not in tokens[i:]:
                return f"option {key!r} opens a list with '[' and no ']' closes it"
            i += tokens[i:].index("]")
        i += 2  # the value, then the token between options
    return None


def torch_logs_refused(error: BaseException, tb: object) -> tuple[int, str] | None:
    """(exit code, line) for the ValueError that `import torch` raised on TORCH_LOGS (torch._logging reads it as
    torch loads), None for any other error. A name torch does not know (`TORCH_LOGS=recompile`, for recompiles) was
    a traceback above a list of every valid name, in every command and rank: now that name, the closest valid one
    (from torch's own list) and exit 2; TORCH_LOGS=help (or +help), which torch answers so, its text and exit 0."""
    ours = isinstance(error, ValueError) and isinstance(tb, TracebackType) and "TORCH_LOGS" in os.environ
    frames = traceback.extract_tb(tb) if ours else []
    if not any(f.filename.replace(os.sep, "/").endswith("torch/_logging/_internal.py") for f in frames):
        return None
    setting, text = os.environ.get("TORCH_LOGS", ""), str(error).strip()
    if setting.strip() in ("help", "+help"):
        return 0, text
    listed = re.search(r"^Valid settings:\s*(.+)", text, re.M | re.S)
    valid = [name.strip() for name in listed[1].split(",")] if listed else []
    parts = [part.strip().lstrip("+-") for part in setting.split(",")]
    unknown = [part for part in parts if part and part not in valid and "." not in part]  # (a.b: a module's logger)
    close = {part: "".join(f" (did you mean {c!r}?)" for c in get_close_matches(part, valid, 1)) for part in unknown}
    said = "; ".join(f"not {part!r}{close[part]}" for part in unknown) or "its import refused it as it stands"
    takes = "comma-separated log and artifact names, each with an optional + or -, or module names"
    return EXIT_USAGE, f"error: TORCH_LOGS={setting!r}: torch takes {takes}; {said}; TORCH_LOGS=help lists them"


def torch_variable_refused(error: BaseException) -> str | None:
    """The line for an environment variable that a module of torch's settings (torch/_inductor/config.py, ...) could
    not read as it loaded, raising `error`: the variable set here that its line names (`int(os.environ.get(
    "TORCHINDUCTOR_COMPILE_THREADS"...))`, TORCH_COMPILE_DEBUG=true: a ValueError's traceback in every rank's
    import of torch._dynamo); None for any other error."""
    frames = traceback.extract_tb(error.__traceback__) if isinstance(error, ValueError) else []
    last = frames[-1] if frames else None
    if last is None or not re.search(r"[/\\]torch[/\\].*config\w*\.py$", last.filename):
        return None
    end = getattr(last, "end_lineno", None) or last.lineno or 0  # a statement of several lines: all of them
    source = "".join(linecache.getline(last.filename, n) for n in range(last.lineno or 0, end + 1))
    named = [name for name in re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']", source) if name in os.environ]
    if not named:
        return None
    said = f"{named[0]}={os.environ[named[0]]!r}: torch cannot read it as it loads ({first_line(error)})"
    return f"{said}; fix it, or unset it"


def is_the_command(module: str) -> bool:
    """Whether `module` (its __name__) is this process's command: run as one (python ddp/train.py, python -m ddp.x:
    "__main__"), or imported by its console script (ddp-train, "python ddp/train.py under another name", whose
    Ctrl-C in torch's import, or its TORCH_DISTRIBUTED_DEBUG, was a traceback)."""
    return module == "__main__" or SCRIPTS.get(os.path.basename(sys.argv[0])) == module


def quiet_startup(module: str) -> None:
    """From a command's module (`module`, its __name__: is_the_command; an import changes nothing), before
    its seconds of imports (torch's), what nothing else handles becomes one line, said by one process per machine
    (speaks_for_its_machine), not a traceback: an environment variable torch's import refuses, exit 2; a Ctrl-C in
    them (one torch lost: cli.command's), INTERRUPTED, and the interpreter ends as Ctrl-C ends it (128 + SIGINT); a
    package this Python lacks (no venv, a torch without one of its own): which one, this interpreter, and how to
    install them; exit 2. Any other exception keeps its traceback (a module of ddp's own missing is a bug) unless a
    Ctrl-C came before it. And errors.standard_streams: a stderr the OS refuses (a hung-up terminal, a full disk) or
    closed (`2>&-`) loses its lines, not the exit code."""
    if not is_the_command(module):
        return
    standard_streams()
    if refused := torch_environment_refused():
        if speaks_for_its_machine():
            print(refused, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE)
    remember_interrupts()
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: object) -> None:
        missing = getattr(value, "name", None) if issubclass(kind, ModuleNotFoundError) else None
        # an error after a Ctrl-C that an import swallowed is the Ctrl-C's: numpy's module left half made by it, then
        # "ImportError: cannot load module more than once per process" (a rank under torchrun, Ctrl-C in its imports)
        ctrl_c = issubclass(kind, KeyboardInterrupt) or interrupted()
        if not ctrl_c and (logs := torch_logs_refused(value, tb)):  # TORCH_LOGS=help too: torch's list, no traceback
            if speaks_for_its_machine():
                print(logs[1], file=sys.stderr if logs[0] else sys.stdout, flush=True)
            os._exit(logs[0])
        if not ctrl_c and (not missing or missing.split(".")[0] == "ddp"):
            return previous(kind, value, tb)
        if speaks_for_its_machine():
            print(INTERRUPTED if ctrl_c else missing_package(missing), file=sys.stderr, flush=True)
        if ctrl_c and not issubclass(kind, KeyboardInterrupt):  # ends as Python ends on one: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        if missing is not None:
            os._exit(EXIT_USAGE)

    sys.excepthook = hook


def as_a_rank(module: str) -> None:
    """ddp/train.py run as one rank of a launcher's (torchrun, srun, accelerate): its oom_score_adj raised before
    torch's import, whose first seconds' memory is the most (processes.first_for_the_oom_killer): the kernel then
    kills a rank, whose launcher says so, not the launcher."""
    if is_the_command(module) and getattr(launched(), "launcher", "none") != "none":
        first_for_the_oom_killer()


def missing_package(name: str) -> str:
    """The line for `import name` failing in this Python: it lacks the packages that pyproject.toml lists."""
    return (
        f"error: no module named {name!r} in {sys.executable}: install ddp-cifar's packages with `make install` "
        "and run with .venv/bin/python (or `source .venv/bin/activate`), or `pip install -e .` into this Python"
    )
