"""Waves from a strategy: `fixed:N` (N nodes a wave), `linear:N` (N, 2N, 3N, ...), `exponential:N`
(N, 2N, 4N, ...), or `plan:FILE`, the waves of `gpucanary plan-sweep --json` (so checkpointed work keeps
compatible capacity), with the nodes it does not name (already current in its inventory) in a last wave."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pytest_gpucanary.errors import ConfigError

STRATEGIES = ("fixed", "linear", "exponential")


@dataclass(frozen=True)
class Strategy:
    kind: str
    size: int = 0
    source: str = ""  # plan: the file
    planned: tuple[tuple[str, ...], ...] = field(default=(), repr=False)

    @classmethod
    def parse(cls, text: str) -> Strategy:
        kind, _, size = text.partition(":")
        if kind == "plan" and size:
            return cls(kind, source=size, planned=_planned(Path(size)))
        if kind not in STRATEGIES or not size.isdigit() or int(size) < 1:
            raise ConfigError(
                f"--waves={text!r} is not a wave strategy",
                hint="fixed:N, linear:N or exponential:N, with N the first wave's size (e.g. fixed:2), "
                "or plan:FILE from `gpucanary plan-sweep --json`",
            )
        return cls(kind, int(size))

    def __str__(self) -> str:
        return f"plan:{self.source}" if self.kind == "plan" else f"{self.kind}:{self.size}"

    def size_of(self, wave: int) -> int:
        """The size of wave `wave` (0-based)."""
        if self.kind == "linear":
            return self.size * (wave + 1)
        if self.kind == "exponential":
            return self.size * 2**wave
        return self.size


def _planned(path: Path) -> tuple[tuple[str, ...], ...]:
    try:
        waves = json.loads(path.read_text())["plan"]["waves"]
        return tuple(tuple(str(n) for n in wave["nodes"]) for wave in waves)
    except OSError as err:
        raise ConfigError(
            f"--waves=plan:{path}: cannot read it ({err.strerror})", hint="the file of `gpucanary plan-sweep --json`"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--waves=plan:{path} is not the JSON of `gpucanary plan-sweep --json`",
            hint="plan the sweep with --json and pass that file",
        ) from None


def waves(nodes: Sequence[str], strategy: Strategy) -> list[list[str]]:
    """The nodes in waves, in name order (or the plan's): the same nodes always make the same waves."""
    if strategy.kind == "plan":
        named = {n for wave in strategy.planned for n in wave}
        if unknown := sorted(named - set(nodes)):
            raise ConfigError(
                f"the sweep plan {strategy.source} names nodes this change does not reach: "
                f"{', '.join(unknown[:5])}" + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""),
                hint="plan the sweep from an inventory of exactly these nodes",
            )
        rest = sorted(set(nodes) - named)
        return [list(wave) for wave in strategy.planned if wave] + ([rest] if rest else [])
    ordered = sorted(nodes)
    planned: list[list[str]] = []
    while ordered:
        size = strategy.size_of(len(planned))
        planned.append(ordered[:size])
        ordered = ordered[size:]
    return planned
