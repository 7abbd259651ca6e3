"""Service SLOs a wave must keep: PromQL queries with a threshold (`--slo 'QUERY < 0.5'`), every series of
the answer on the right side of it, read at every look at the wave. A Prometheus that cannot answer, or an
answer with no series, is not a pass: three looks in a row without one fail the wave (hold when unsure)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pytest_gpucanary.canary.metrics import MetricsError, Prometheus, Series
from pytest_gpucanary.errors import ConfigError

UNANSWERED_LOOKS = 3
_SLO = re.compile(r"^(?P<query>.+?)\s*(?P<op><=|>=|<|>)\s*(?P<threshold>[-+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class Slo:
    query: str
    op: str
    threshold: float

    @classmethod
    def parse(cls, text: str) -> Slo:
        found = _SLO.match(text.strip())
        if not found:
            raise ConfigError(
                f"--slo={text!r} is not a query and a threshold",
                hint="e.g. --slo='histogram_quantile(0.99, sum by (le) "
                "(rate(http_request_duration_seconds_bucket[1m]))) < 0.5'",
            )
        try:
            threshold = float(found["threshold"])
        except ValueError:
            raise ConfigError(f"--slo={text!r}: {found['threshold']!r} is not a number", hint="e.g. < 0.5") from None
        return cls(found["query"], found["op"], threshold)

    def __str__(self) -> str:
        return f"{self.query} {self.op} {self.threshold:g}"

    def broken(self, series: Sequence[Series]) -> str:
        """The first value that breaks the SLO, with its labels ("" when every series keeps it)."""
        for s in series:
            if not _holds(s.value, self.op, self.threshold):
                where = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "__name__")
                return f"{s.value:g}" + (f" on {{{where}}}" if where else "")
        return ""


def _holds(value: float, op: str, threshold: float) -> bool:
    return {"<": value < threshold, "<=": value <= threshold, ">": value > threshold, ">=": value >= threshold}[op]


class SloLook:
    """The SLOs read at each look at a wave; a miss (no answer, no series) counts until it is answered again."""

    def __init__(self, prometheus: Prometheus | None, slos: Sequence[Slo]) -> None:
        self.prometheus, self.slos = prometheus, list(slos)
        self._misses: dict[Slo, int] = {}

    def failure(self) -> str:
        """Why the SLOs fail the wave now, or ""."""
        for slo in self.slos:
            assert self.prometheus is not None, "SLOs are given with a Prometheus"
            try:
                series = self.prometheus.query(slo.query)
            except MetricsError as err:
                missed = str(err)
            else:
                missed = "" if series else "no series"
                if why := slo.broken(series):
                    return f"SLO `{slo}` broken: {why}"
            self._misses[slo] = self._misses.get(slo, 0) + 1 if missed else 0
            if self._misses[slo] >= UNANSWERED_LOOKS:
                return f"SLO `{slo}` unanswered {UNANSWERED_LOOKS} looks in a row ({missed})"
        return ""
