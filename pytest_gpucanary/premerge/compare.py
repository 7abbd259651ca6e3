"""Base vs head: two judged runs of the same canary, one side-by-side verdict.

Pure: takes each side's `RunEvidence` and `LadderResult` (as the ladder computed them) and returns
the regressions of head against base; never judges a run itself and never talks to a cluster. The
gate passes when head passes the ladder AND no rule below finds head worse than base:
- a stage that passed on base and fails or is inconclusive on head;
- more evictions on head than on base, per kind of pod (GPU / non-GPU, allowed or not);
- a service phase over its SLO (error ratio or p99, head's thresholds) where base was within it;
- an upgrade over its budget (time to upgrade-done from the upgrade start) where base was within it.
Each side's offsets are from its own upgrade start (client receive time), so the two line up there.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from pytest_gpucanary.gpu_operator import UPGRADE_DONE
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Eviction, LadderResult, Outcome, PhaseStats, Stage, UpgradePhase

WORSE = frozenset({Outcome.FAIL, Outcome.INCONCLUSIVE})
# a Deployment's pod is <name>-<pod-template-hash>-<5 chars>, a Job's <name>-<5 chars>: the run ids and
# the hashes differ between the two runs, the workload's name does not
_POD_SUFFIX = re.compile(r"(-[a-z0-9]{6,10})?-[a-z0-9]{5}$")


@dataclass(frozen=True)
class Side:
    """One run of the pair: what it recorded and what the ladder made of it."""

    label: str  # "base" or "head"
    evidence: RunEvidence
    result: LadderResult

    def upgrade_s(self) -> float | None:
        """Seconds from the upgrade start to the first pool node's upgrade-done (client receive time)."""
        done = [
            s.start_wall_ns
            for s in self.result.state_spans
            if s.state == UPGRADE_DONE and s.start_wall_ns >= self.evidence.upgrade_started_wall_ns
        ]
        return self.evidence.offset_s(min(done)) if done else None


@dataclass(frozen=True)
class Regression:
    rule: str  # "stage", "evictions", "service", "upgrade"
    line: str  # one line: what head did that base did not


@dataclass(frozen=True)
class Comparison:
    base: Side
    head: Side
    regressions: tuple[Regression, ...]

    @property
    def gate_passed(self) -> bool:
        return self.head.result.gate_passed and not self.regressions

    def headline(self) -> str:
        if self.gate_passed:
            return "Gate PASSED: head passes the canary and is no worse than base"
        if not self.head.result.gate_passed and self.head.result.first_failed is not None:
            reason = f"head fails at stage {self.head.result.first_failed.value}"
        else:
            reason = "head passes but is worse than base"
        return f"Gate FAILED: {reason}; {len(self.regressions)} regression(s) against base"


def workload_of(eviction: Eviction) -> str:
    """The evicted pod's workload name, the same on both runs (namespace and hash suffixes dropped)."""
    return _POD_SUFFIX.sub("", eviction.name)


def eviction_kind(eviction: Eviction) -> str:
    return f"{'GPU' if eviction.gpus else 'non-GPU'} pod, {'allowed' if eviction.allowed else 'not allowed'}"


def compare(base: Side, head: Side) -> Comparison:
    return Comparison(
        base,
        head,
        tuple(
            stage_regressions(base, head)
            + eviction_regressions(base, head)
            + service_regressions(base, head)
            + upgrade_regressions(base, head)
        ),
    )


def stage_regressions(base: Side, head: Side) -> list[Regression]:
    found = []
    for was in base.result.verdicts:
        now = next((v for v in head.result.verdicts if v.stage is was.stage), None)
        if was.outcome is Outcome.PASS and (now is None or now.outcome in WORSE):
            summary = now.summary if now else "no verdict"
            found.append(
                Regression(
                    "stage",
                    f"{was.stage.value} passed on base, {now.outcome.value if now else 'missing'} on head: {summary}",
                )
            )
    return found


def eviction_regressions(base: Side, head: Side) -> list[Regression]:
    """Per kind of pod, head's evictions beyond base's count, each named by head's own line."""
    before = Counter(eviction_kind(e) for e in base.result.evictions)
    found: list[Regression] = []
    seen: Counter[str] = Counter()
    for e in head.result.evictions:
        kind = eviction_kind(e)
        seen[kind] += 1
        if seen[kind] > before[kind]:
            found.append(
                Regression(
                    "evictions", f"head evicts one more {kind} than base ({seen[kind]} vs {before[kind]}): {e.line()}"
                )
            )
    return found


def eviction_diff(base: Side, head: Side) -> tuple[list[Eviction], list[Eviction]]:
    """Evictions only base had and only head had, matched by (kind, workload)."""

    def key(e: Eviction) -> tuple[str, str]:
        return eviction_kind(e), workload_of(e)

    only_base = list(base.result.evictions)
    only_head = []
    for e in head.result.evictions:
        twin = next((b for b in only_base if key(b) == key(e)), None)
        if twin is None:
            only_head.append(e)
        else:
            only_base.remove(twin)
    return only_base, only_head


def over_slo(stats: PhaseStats | None, thresholds: dict) -> str | None:
    """Why a phase's figures break the service SLO, or None when within it (or not enough to tell)."""
    if stats is None or not stats.requests:
        return None
    ratio = stats.failures / stats.requests
    if ratio > thresholds["max_error_ratio"]:
        return f"error ratio {ratio:.3f} ({stats.failures}/{stats.requests}) > {thresholds['max_error_ratio']:g}"
    if stats.p99_s is not None and stats.p99_s > thresholds["max_p99_s"]:
        return f"p99 = {stats.p99_s:.3f} s (n={stats.requests}) > {thresholds['max_p99_s']:g} s"
    return None


def service_regressions(base: Side, head: Side) -> list[Regression]:
    limits = dict(head.result.thresholds)
    if not {"max_error_ratio", "max_p99_s"} <= limits.keys():
        return []
    found = []
    for phase in UpgradePhase:
        was = next((s for s in base.evidence.service_phases if s.phase is phase), None)
        now = next((s for s in head.evidence.service_phases if s.phase is phase), None)
        why = over_slo(now, limits)
        if why and was is not None and was.requests and over_slo(was, limits) is None:
            found.append(
                Regression(
                    "service",
                    f"service phase {phase.value} over its SLO on head, within it on "
                    f"base: {why} (load generator clock)",
                )
            )
    return found


def upgrade_regressions(base: Side, head: Side) -> list[Regression]:
    budget_s = head.result.thresholds.get("upgrade_budget_s")
    now_s, was_s = head.upgrade_s(), base.upgrade_s()
    if budget_s is None or now_s is None or now_s <= budget_s:
        return []
    if was_s is not None and was_s > budget_s:
        return []
    was = f"{was_s:.0f} s" if was_s is not None else "not reached"
    return [
        Regression(
            "upgrade",
            f"upgrade took {now_s:.0f} s on head > budget {budget_s:.0f} s (base: {was}; client receive time)",
        )
    ]


def stage_pairs(comparison: Comparison) -> list[tuple[Stage, Outcome | None, Outcome | None]]:
    """Per stage in ladder order: base's outcome and head's (None when a side has no verdict)."""

    def outcome(side: Side, stage: Stage) -> Outcome | None:
        return next((v.outcome for v in side.result.verdicts if v.stage is stage), None)

    return [(stage, outcome(comparison.base, stage), outcome(comparison.head, stage)) for stage in Stage]
