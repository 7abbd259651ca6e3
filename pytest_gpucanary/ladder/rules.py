"""How a stage's findings become its verdict: the worst outcome wins, its line leads, the rest are counted.

Shared by the stage modules; pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_gpucanary.ladder import metrics
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Evidence, Outcome, Stage, StageVerdict

if TYPE_CHECKING:
    from pytest_gpucanary.config import Settings


@dataclass(frozen=True)
class Finding:
    outcome: Outcome
    line: str  # the summary without the "stage: " prefix


def verdict(stage: Stage, findings: Iterable[Finding], evidence: Iterable[Evidence], pass_line: str) -> StageVerdict:
    findings = list(findings)
    for outcome in (Outcome.FAIL, Outcome.INCONCLUSIVE):
        bad = [f for f in findings if f.outcome is outcome]
        if bad:
            more = f" (+{len(bad) - 1} more {outcome.value})" if len(bad) > 1 else ""
            return StageVerdict(stage, outcome, f"{stage.value}: {bad[0].line}{more}", tuple(evidence))
    return StageVerdict(stage, Outcome.PASS, f"{stage.value}: {pass_line}", tuple(evidence))


def stage_metrics(ev: RunEvidence, stage: Stage, settings: Settings) -> tuple[list[Finding], list[Evidence]]:
    """The stage's Prometheus checks, judged from the recorded answers, as findings (skipped checks only as
    evidence)."""
    findings, items = [], []
    for check in (c for c in metrics.checks(ev, settings) if c.stage is stage):
        value = "no value" if check.value is None else f"{check.value:g}"
        line = f"metric {check.name} = {value} ({check.detail})"
        items.append(Evidence(None, None, "Metric", check.name, f"{check.outcome.value}: {line}"))
        if check.outcome is not Outcome.SKIPPED:
            findings.append(Finding(check.outcome, line))
    return findings, items


def metrics_note(findings: list[Finding]) -> str:
    return f"; {len(findings)} metric check(s) passed" if findings else ""


def at(ev: RunEvidence, wall_ns: int, kind: str, ref: str, text: str) -> Evidence:
    """An evidence item at a recorded instant, with its offset from the upgrade start."""
    return Evidence(wall_ns, ev.offset_s(wall_ns), kind, ref, text)
