import ast
import re

from conftest import REPO

from ddp import config


def test_readme_config_reference_is_current():
    assert config.reference() in (REPO / "README.md").read_text()


def test_readme_quick_start_is_two_make_commands():
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```", 2)[1]  # "bash\nmake train ...\nmake test ...\n"
    commands = [line.split()[:2] for line in block.splitlines()[1:] if line.strip()]
    assert commands == [["make", "train"], ["make", "test"]]


def read_the_code() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## Read the code", 1)[1].split("\n## ", 1)[0]


def function_source(path, dotted: str) -> str | None:
    """The source of `dotted` (a function, or Class.method) in the file at `path`, or None."""
    tree, text = ast.parse(path.read_text()), path.read_text()
    body = tree.body
    for part in dotted.split("."):
        found = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if found is None:
            return None
        body = found.body
    return ast.get_source_segment(text, found)


def test_the_read_the_code_map_names_functions_that_show_their_calls():
    """Each step of the map: the function exists, contains every call listed for it, and is in
    ddp/train.py or called by name from there, in at most 40 lines (one call away, short)."""
    rows = [line for line in read_the_code().splitlines() if line.startswith("| ") and "`ddp/" in line]
    assert len(rows) >= 11, rows
    train = (REPO / "ddp" / "train.py").read_text()
    for row in rows:
        _, where, calls = [cell.strip() for cell in row.strip("|").split(" | ")]
        file, function = where.strip("`").split(":")
        source = function_source(REPO / file, function)
        assert source is not None, f"{where}: no such function"
        for call in re.findall(r"`([^`]+)`", calls):
            assert call in source, f"{where} no longer contains `{call}`"
        if file != "ddp/train.py":
            module, name = file.removeprefix("ddp/").removesuffix(".py"), function.split(".")[-1]
            called = f"{module}.{name}(" if "." not in function else f".{name}("
            assert called in train, f"{where} is not called from ddp/train.py"
            assert len(source.splitlines()) <= 40, f"{where} has {len(source.splitlines())} lines"


def test_the_maps_path_is_at_most_300_lines():
    """What a newcomer reads to follow the map: each function it names, once (the goal of issue 21;
    pytorch/examples' multigpu_torchrun.py tells the DDP story in 111 lines)."""
    rows = [line for line in read_the_code().splitlines() if line.startswith("| ") and "`ddp/" in line]
    wheres = {row.strip("|").split(" | ")[1].strip().strip("`") for row in rows}
    lines = {
        where: len(function_source(REPO / where.split(":")[0], where.split(":")[1]).splitlines()) for where in wheres
    }
    assert sum(lines.values()) <= 300, sorted(lines.items(), key=lambda item: -item[1])


def test_the_module_list_names_every_module_once():
    listed = re.findall(r"^ddp/(\w+)\.py ", read_the_code(), flags=re.M)
    modules = sorted(p.stem for p in (REPO / "ddp").glob("*.py") if p.stem != "__init__")
    assert sorted(listed) == modules
