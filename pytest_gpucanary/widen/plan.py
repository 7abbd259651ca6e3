"""Wave sizes from a strategy: `fixed:N` (N nodes a wave), `linear:N` (N, 2N, 3N, ...), `exponential:N`
(N, 2N, 4N, ...). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pytest_gpucanary.errors import ConfigError

STRATEGIES = ("fixed", "linear", "exponential")


@dataclass(frozen=True)
class Strategy:
    kind: str
    size: int

    @classmethod
    def parse(cls, text: str) -> Strategy:
        kind, _, size = text.partition(":")
        if kind not in STRATEGIES or not size.isdigit() or int(size) < 1:
            raise ConfigError(f"--waves={text!r} is not a wave strategy",
                              hint="fixed:N, linear:N or exponential:N, with N the first wave's size (e.g. fixed:2)")
        return cls(kind, int(size))

    def __str__(self) -> str:
        return f"{self.kind}:{self.size}"

    def size_of(self, wave: int) -> int:
        """The size of wave `wave` (0-based)."""
        if self.kind == "linear":
            return self.size * (wave + 1)
        if self.kind == "exponential":
            return self.size * 2 ** wave
        return self.size


def waves(nodes: Sequence[str], strategy: Strategy) -> list[list[str]]:
    """The nodes in waves, in name order: the same nodes always make the same plan."""
    ordered, planned = sorted(nodes), []
    while ordered:
        size = strategy.size_of(len(planned))
        planned.append(ordered[:size])
        ordered = ordered[size:]
    return planned
