"""A config file: YAML read as sections of keys (`read`), with YAML 1.2's booleans alone (`amp: off` stays "off"),
a key given twice refused, and a key outside a section shown in its section; and written (`write`). The only module
that imports yaml; what the keys mean is config.py's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ddp import files
from ddp.errors import UsageError


class _Yaml12(yaml.SafeLoader):
    """SafeLoader where only true/false are booleans (`amp: off` stays "off"), and a key given twice is an error."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [(k, self.construct_object(k, deep=deep)) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
        for i, (key, name) in enumerate(keys):  # PyYAML would keep the last silently: a section written twice
            if name in [n for _, n in keys[:i]]:
                raise yaml.constructor.ConstructorError(None, None, f"{name!r} is given twice", key.start_mark)
        return super().construct_mapping(node, deep)


_Yaml12.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read(path: str, settings: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The config file at `path` as its sections of keys ({} for an empty one); UsageError in one line for a file
    that is none. With `settings` (each section's keys), a key outside a section is shown in the one(s) it has."""
    try:
        if (data := files.read_small(Path(path).expanduser(), 2**20)) is None:  # a config is a few hundred bytes
            raise UsageError(f"{path}: more than 1 MiB, not a config file; name a YAML file, e.g. configs/quick.yaml")
        doc = yaml.load(data.decode(), Loader=_Yaml12)
    except RecursionError:  # [[[[... or {a: {a: ...: the parser's recursion
        raise UsageError(f"{path}: invalid YAML: nested too deeply for a config (sections of keys)") from None
    except FileNotFoundError:
        raise UsageError(f"config file not found: {path}") from None
    except OSError as e:  # a directory, no permission to read it
        raise UsageError(f"--config {path}: {e.strerror}; name a YAML file, e.g. configs/quick.yaml") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # the second: not a text file
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark else ""
        said = " ".join(str(getattr(e, "problem", None) or e).split())  # one line (a reader error's is two)
        said += " (YAML takes spaces there, never tabs)" if "'\\t'" in said else ""  # (an editor's tab key)
        raise UsageError(f"{path}:{where} invalid YAML: {said}") from None
    example = "e.g. 'optim:\\n  lr: 0.1'"
    if not isinstance(doc := {} if doc is None else doc, dict):
        raise UsageError(f"{path}: expected sections of keys; {example}")
    doc = {section: {} if keys is None else keys for section, keys in doc.items()}  # (its keys all commented out)
    if loose := [(str(k), v) for k, v in doc.items() if not isinstance(v, dict)]:  # epochs: 10, or train.epochs: 10
        value = "..." if isinstance(loose[0][1], list) else loose[0][1]  # (YAML's aliases make a billion items)
        nested = " or ".join(_in_its_section(loose[0][0], value, settings or {}))
        hint = f"write '{loose[0][0]}: {value}' as {nested}" if nested else example
        raise UsageError(f"{path}: expected sections of keys; {hint}")
    return doc


def _in_its_section(name: str, value: Any, settings: dict[str, list[str]]) -> list[str]:
    """A setting given outside a section, as a config file writes it ('train:\\n  epochs: 10'), once for each
    section of `settings` that has its key (none: an unknown key)."""
    found = [s for s in settings if name.startswith(f"{s}.")] or [s for s in settings if name in settings[s]]
    return [f"'{s}:\\n  {name.removeprefix(s + '.')}: {value}'" for s in found]


def write(sections: dict[str, dict[str, Any]]) -> str:
    """Sections of keys as a config file holds them, in their order (a run's config.yaml)."""
    return yaml.safe_dump(sections, sort_keys=False)
