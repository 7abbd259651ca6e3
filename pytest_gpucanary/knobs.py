"""The machinery of knobs: a setting declared once, as a dataclass field (`knob(...)`), seen from outside as a
`Knob` with its names, type, default, check and help. The run's `Settings` (config.py) and the local fleet's
own (fleet/layout.py, environment only) are declared with it; each resolves from a chain of sources, the first
that answers winning, and checks every value it ends up with.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_gpucanary.checks import Check
from pytest_gpucanary.errors import ConfigError


def knob(
    default: Any, help: str, *, check: Check | None = None, threshold: bool = False, env_only: bool = False
) -> Any:
    return field(default=default, metadata={"help": help, "check": check, "threshold": threshold, "env_only": env_only})


@dataclass(frozen=True)
class Knob:
    """One field of a settings class, seen from the outside: its names, type, default, check and help."""

    name: str
    type: type
    default: Any
    help: str
    check: Check | None
    threshold: bool
    env_only: bool = False  # set only in the environment (the local fleet's), so messages name the variable

    @property
    def flag(self) -> str:
        return "--gpucanary-" + self.name.replace("_", "-")

    @property
    def ini(self) -> str:
        return "gpucanary_" + self.name

    @property
    def env(self) -> str:
        return "GPUCANARY_" + self.name.upper()

    @property
    def shown(self) -> str:
        """How a message spells it: the flag, or the variable of an environment-only knob."""
        return self.env if self.env_only else self.flag

    def problem(self, what: str) -> ConfigError:
        hint = "" if self.env_only else f"also settable as ini {self.ini} or env {self.env}"
        return ConfigError(f"{self.shown}={what}", hint=hint)

    def convert(self, raw: Any) -> Any:
        if raw is None or isinstance(raw, self.type) and (self.type is bool or not isinstance(raw, bool)):
            return raw
        text = str(raw).strip()
        try:
            if self.type is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(text)
            return self.type(text)
        except ValueError:
            kind = "a whole number" if self.type is int else f"a valid {self.type.__name__}"
            raise self.problem(f"{text!r} is not {kind}") from None


def _base_type(hint: Any) -> type:
    """`Path | None` -> Path."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def knobs_of(cls: type) -> tuple[Knob, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(
        Knob(
            f.name,
            _base_type(hints[f.name]),
            f.default,
            f.metadata["help"],
            f.metadata["check"],
            f.metadata["threshold"],
            f.metadata.get("env_only", False),
        )
        for f in dataclasses.fields(cls)
    )


def check_all(settings: object, knobs: tuple[Knob, ...]) -> None:
    """Each value against its knob's check: the first problem is one ConfigError naming the knob."""
    for knob_ in knobs:
        value = getattr(settings, knob_.name)
        if knob_.check is not None and value is not None and (problem := knob_.check(value)):
            raise knob_.problem(f"{value!r} {problem}")


def resolve_values(knobs: tuple[Knob, ...], sources: tuple[Callable[[Knob], Any], ...]) -> dict[str, Any]:
    """Knob by knob, the first source that answers (not None) wins, else the default."""
    values = {}
    for knob_ in knobs:
        raw = next((v for source in sources if (v := source(knob_)) is not None), knob_.default)
        values[knob_.name] = knob_.convert(raw)
    return values


def env_source(environ: Mapping[str, str]) -> Callable[[Knob], Any]:
    return lambda knob_: environ.get(knob_.env) or None
