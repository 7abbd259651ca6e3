"""The user's YAML files, read strictly: a key given twice is refused, and each error is one line.

Every YAML file a user hands the canary (a policy, a workload manifest, a sweep inventory) is read through
`read_text` and `yaml_documents`, so a file that cannot be read, is not UTF-8, is not YAML or gives a key
twice says so in one `ConfigError` line with where it is.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from pytest_gpucanary.errors import ConfigError


def _strict(base: type[yaml.constructor.SafeConstructor]) -> type:
    """Safe loading that refuses a key given twice in one mapping (plain YAML lets the last one win)."""

    def construct_mapping(self: Any, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark
                    )
                seen[key] = key_node.start_mark.line
        return base.construct_mapping(self, node, deep=deep)

    return type(f"Strict{base.__name__}", (base,), {"construct_mapping": construct_mapping})


_FAST_LOADER = _strict(getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: a 40 MB policy in 2 s, not 18
_EXACT_LOADER = _strict(yaml.SafeLoader)  # where an error is, line and column


def yaml_documents(text: str, *, source: str) -> list[Any]:
    """Every non-empty document of a user's YAML text; bad syntax or a duplicate key is one ConfigError line."""
    try:
        return [doc for doc in yaml.load_all(text, Loader=_FAST_LOADER) if doc is not None]
    except yaml.YAMLError:
        pass
    try:  # parse again with the pure-Python loader, whose marks point at the cause, not at the end of input
        return [doc for doc in yaml.load_all(text, Loader=_EXACT_LOADER) if doc is not None]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or "unreadable").split())
        raise ConfigError(
            f"{source} is not valid YAML{where}: {problem}",
            hint="fix the syntax (indent with spaces; quote values that contain ': ')",
        ) from None


def read_text(path: Path, *, what: str) -> str:
    """A user's file as text, or one ConfigError line saying why not."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text", hint="give a YAML file") from None
    except OSError as err:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {err.strerror or err}", hint="check the path") from None
