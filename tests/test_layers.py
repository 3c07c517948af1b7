"""The package in layers: ddp/__init__.py lists its modules top to bottom, and no module imports one
above it, so none lean on each other in a circle. Read from the source (ast): nothing runs."""

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO
from test_readme import read_the_code


def layers(package: Path) -> list[tuple[str, list[str]]]:
    """(layer name, its modules) top to bottom, from the package docstring's indented block
    `    name    module, module, ...` (two spaces or more between the name and the modules; a row whose modules
    go on, ending in a comma, goes on in the next line's, which has no name)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    found: list[tuple[str, list[str]]] = []
    for line in (line for line in doc.splitlines() if line.startswith("    ")):
        if found and found[-1][1][-1] == "":  # (the row above ended in a comma)
            found[-1][1][-1:] = [m.strip() for m in line.strip().split(",")]
        else:
            name, modules = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            found.append((name, [m.strip() for m in modules.split(",")]))
    return found


def imports(path: Path, package: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import of a module of `package` in the file: at the top, inside a
    function and under TYPE_CHECKING alike."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith(f"{package}.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == package:
            names = [a.name for a in node.names]  # `from ddp import checkpoint, __version__`
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(f"{package}.")):
            names = [(node.module or "").removeprefix(f"{package}.").split(".")[0]] if node.module else []
            names += [a.name for a in node.names] if node.level and not node.module else []  # `from . import x`
        else:
            continue
        found += [(node.lineno, name) for name in names if name in modules]
    return found


def upward_imports(package: Path) -> list[str]:
    """One line for every import of a module above the importer (or not in the layers), naming the
    file, its line and, where the two now import each other through a chain, the cycle."""
    order = [m for _, modules in layers(package) for m in modules]
    files = {p.stem: p for p in package.glob("*.py") if p.stem != "__init__"}
    problems = [
        f"{package.name}/{m}.py is in no layer of {package.name}/__init__.py" for m in sorted(set(files) - set(order))
    ]
    problems += [f"{package.name}/__init__.py lists {m}, which is not a module" for m in order if m not in files]
    graph = {m: imports(p, package.name, set(files)) for m, p in files.items()}
    for module in order:
        for line, imported in graph.get(module, []):
            if imported == module or (imported in order and order.index(imported) > order.index(module)):
                continue
            cycle = _path(graph, imported, module)
            problems.append(
                f"{package.name}/{module}.py:{line} imports {package.name}.{imported}, which is above it"
                + (f" (a cycle: {' -> '.join([module, *cycle])})" if cycle else "")
            )
    return problems


def _path(graph: dict[str, list[tuple[int, str]]], start: str, goal: str) -> list[str] | None:
    """A chain of imports from `start` to `goal`, or None."""
    seen, paths = {start}, [[start]]
    while paths:
        path = paths.pop(0)
        if path[-1] == goal:
            return path
        for _, nxt in graph.get(path[-1], []):
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    return None


def test_no_module_of_ddp_imports_one_above_it():
    assert upward_imports(REPO / "ddp") == []


def test_the_readme_lists_the_modules_in_the_layers_of_the_package_docstring():
    """README's module list: the same layers, in the same order, each module once."""
    listed, current = [], None
    for line in read_the_code().split("```", 2)[1].splitlines():
        if re.fullmatch(r"[a-z' ]+:", line):
            current = (line[:-1], [])
            listed.append(current)
        elif m := re.match(r"ddp/(\w+)\.py ", line):
            current[1].append(m.group(1))
    assert listed == layers(REPO / "ddp")


PACKAGE = '''"""pkg: a test package.

Its layers:

    top       c
    bottom    b,
              a
"""
'''


@pytest.mark.parametrize(
    "sources, expected",
    [
        ({"a": "", "b": "from pkg import a\n", "c": "import pkg.b\nfrom pkg.a import x\n"}, []),
        ({"a": "from pkg import b\n", "b": "", "c": ""}, ["pkg/a.py:1 imports pkg.b, which is above it"]),
        ({"a": "", "b": "def f():\n    from pkg.c import y\n", "c": "from . import b\n"},
         ["pkg/b.py:2 imports pkg.c, which is above it (a cycle: b -> c -> b)"]),
        ({"a": "if TYPE_CHECKING:\n    from .c import T\n", "b": "", "c": "", "d": ""},
         ["pkg/d.py is in no layer of pkg/__init__.py", "pkg/a.py:2 imports pkg.c, which is above it"]),
    ],
)  # fmt: skip
def test_the_check_names_each_import_against_the_layers(tmp_path, sources, expected):
    """The check itself, on a made-up package: below is fine; above, in a function, under
    TYPE_CHECKING, relative, or a module in no layer, each is named."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(PACKAGE)
    for name, source in sources.items():
        (package / f"{name}.py").write_text(source)
    assert upward_imports(package) == expected
