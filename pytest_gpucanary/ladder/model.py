"""The ladder's vocabulary: stages, outcomes, the records a run's evidence is made of, verdicts, the result.

Pure frozen data; no rules here (those are the stage modules) and no I/O. Times are client receive
times (wall clock, Unix ns) unless a field says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from pytest_gpucanary.gpu_operator import (
    DRAIN_REQUIRED,
    POD_DELETION_REQUIRED,
    UPGRADE_DONE,
    UPGRADE_FAILED,
    UPGRADE_REQUIRED,
)

if TYPE_CHECKING:
    from pytest_gpucanary.config import Settings
    from pytest_gpucanary.ladder.cause import Cause


class Stage(str, Enum):
    ROLLOUT = "rollout"
    DEVICE = "device"
    NETWORK = "network"
    SCHEDULER = "scheduler"
    APPLICATION = "application"


class Outcome(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"


class ProbeScope(str, Enum):
    POOL = "pool"  # pinned to the canary pool: measures queue delay while it is cordoned
    FLEET = "fleet"  # anywhere: measures the customer's start latency


class UpgradePhase(str, Enum):
    """Coarse upgrade phases, as the load generator's stats are cut."""

    BEFORE = "before"
    DRAIN = "drain"  # cordon, wait for jobs, pod deletion, drain
    RESTART = "restart"  # driver pod restart, validation, uncordon
    AFTER = "after"  # upgrade-done or upgrade-failed


# States outside this table (the operator's requestor mode) keep the phase they occur in.
PHASE_OF_STATE: Mapping[str, UpgradePhase] = {
    "": UpgradePhase.BEFORE,
    UPGRADE_REQUIRED: UpgradePhase.BEFORE,
    "cordon-required": UpgradePhase.DRAIN,
    "wait-for-jobs-required": UpgradePhase.DRAIN,
    POD_DELETION_REQUIRED: UpgradePhase.DRAIN,
    DRAIN_REQUIRED: UpgradePhase.DRAIN,
    "pod-restart-required": UpgradePhase.RESTART,
    "validation-required": UpgradePhase.RESTART,
    "uncordon-required": UpgradePhase.RESTART,
    UPGRADE_DONE: UpgradePhase.AFTER,
    UPGRADE_FAILED: UpgradePhase.AFTER,
}


@dataclass(frozen=True)
class Evidence:
    """One item a verdict points at in the recorded timeline."""

    received_wall_ns: int | None  # client receive time; None for figures computed elsewhere (metrics, load)
    offset_s: float | None  # seconds from upgrade start, same clock
    kind: str
    ref: str  # namespace/name, or the name of a cluster-scoped object
    text: str


@dataclass(frozen=True)
class StageVerdict:
    stage: Stage
    outcome: Outcome
    summary: str  # one line: stage, measured value, threshold
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True)
class WorkloadRef:
    namespace: str
    name: str
    uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ProbeSeen:
    """One customer start probe: when it was created, and when the watch first saw it scheduled and running."""

    name: str
    scope: ProbeScope
    created_wall_ns: int  # client clock just before the create call
    scheduled_wall_ns: int | None  # first watch event with PodScheduled=True (client receive time)
    running_wall_ns: int | None  # first watch event with phase Running or Succeeded (client receive time)
    node: str | None
    ended_wall_ns: int | None = None  # its pod failed or went away before running (e.g. evicted by a drain)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scope", ProbeScope(self.scope))


@dataclass(frozen=True)
class MetricCheck:
    name: str
    stage: Stage
    outcome: Outcome  # Prometheus unreachable arrives as INCONCLUSIVE
    value: float | None
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", Stage(self.stage))
        object.__setattr__(self, "outcome", Outcome(self.outcome))


@dataclass(frozen=True)
class PhaseStats:
    phase: UpgradePhase
    requests: int
    failures: int
    p50_s: float | None  # load generator's clock
    p95_s: float | None
    p99_s: float | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", UpgradePhase(self.phase))


@dataclass(frozen=True, slots=True)
class Sample:
    """One request of the service load, as the load generator saw it."""

    t_ns: int  # wall clock at request start, Unix ns
    latency_s: float  # request start to response (or error)
    ok: bool  # locust's verdict: a 2xx/3xx response, no connection error
    status: int  # HTTP status; 0 when no response arrived


@dataclass(frozen=True)
class Series:
    """One sample of a Prometheus instant vector."""

    labels: Mapping[str, str] = field(hash=False)
    t_s: float  # sample time, Prometheus clock (Unix s)
    value: float


@dataclass(frozen=True)
class MetricAnswer:
    """What Prometheus answered to one of the shipped checks' queries, unjudged: the ladder judges it."""

    name: str  # the check it is for: no-upgrade-failed, no-xid-errors, dcgm-driver-version
    query: str  # the PromQL as asked
    span: str  # the window the query covers, e.g. "642s"
    series: tuple[Series, ...] = ()
    error: str = ""  # why there is no answer (unreachable, timed out, an error status); "" when answered

    def __post_init__(self) -> None:
        object.__setattr__(self, "series", tuple(s if isinstance(s, Series) else Series(**s) for s in self.series))


@dataclass(frozen=True)
class RatePoint:
    start_wall_ns: int  # bucket start, a multiple of the bucket width (load generator's wall clock)
    bucket_s: float
    requests: int
    errors: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.bucket_s

    @property
    def errors_per_s(self) -> float:
        return self.errors / self.bucket_s


@dataclass(frozen=True)
class PhaseWindow:
    phase: UpgradePhase
    start_wall_ns: int
    end_wall_ns: int


@dataclass(frozen=True)
class StateSpan:
    """One stretch of a node's upgrade-state label, as the receipt draws it."""

    node: str
    state: str
    start_wall_ns: int
    end_wall_ns: int


@dataclass(frozen=True)
class Eviction:
    node: str
    namespace: str
    name: str
    gpus: int
    disruption_reason: str  # e.g. EvictionByEvictionAPI; "" when the pod was deleted without one
    by_drain: bool  # the node passed through drain-required before the removal
    allowed: bool
    received_wall_ns: int
    offset_s: float  # from the upgrade start
    allowed_text: str  # what the run allowed, e.g. "GPU pods only"

    def line(self) -> str:
        what = "GPU pod" if self.gpus else "non-GPU pod"
        verb = "evicted" if self.disruption_reason else "deleted"
        how = "by drain" if self.by_drain else "by pod deletion"
        return (
            f"{what} {self.namespace}/{self.name} {verb} {how} at +{self.offset_s:.0f}s (allowed: {self.allowed_text})"
        )


@dataclass(frozen=True)
class CapacityDip:
    """One pool node's GPUs leaving allocatable during its upgrade and coming back (times from the upgrade start)."""

    node: str
    before: int | None  # allocatable GPUs before the node's upgrade cycle
    lowest: int | None  # fewest allocatable during the cycle
    left_s: float | None  # first drop below `before`
    back_s: float | None  # first return to `before` after the drop
    after: int | None  # allocatable at the end of the recording
    series: tuple[tuple[float, int | None], ...] = ()  # (offset s, allocatable) at each change, for the receipt

    @property
    def gone_s(self) -> float | None:
        return None if self.left_s is None or self.back_s is None else self.back_s - self.left_s

    def line(self) -> str:
        if self.left_s is None:
            return f"{self.node}: {self.before} GPUs allocatable throughout (no dip recorded)"
        if self.back_s is None:
            return (
                f"{self.node}: GPUs left allocatable at +{self.left_s:.1f}s ({self.before} -> {self.lowest}) "
                f"and were not back when the recording ended ({self.after})"
            )
        return (
            f"{self.node}: GPUs left allocatable at +{self.left_s:.1f}s ({self.before} -> {self.lowest}), back "
            f"at +{self.back_s:.1f}s: gone {self.gone_s:.1f} s"
        )


@dataclass(frozen=True)
class CollectiveRun:
    """One run of the collective probe: an all-reduce between two pods on two nodes, before the policy is
    applied (baseline) or once the pool is back (after). Times: wall clock, Unix ns."""

    when: str  # "baseline" or "after"
    nodes: tuple[str, ...]  # rank 0's node, rank 1's node
    drivers: tuple[str, ...]  # each node's driver version (GFD's label) when the probe started
    started_wall_ns: int
    ended_wall_ns: int | None  # None: not complete within its timeout
    busbw_gbps: float | None  # the "# Avg bus bandwidth" its rank 0 printed (GB/s); None: none printed
    how: str  # "ran" (real processes) or "simulated" (a node with no processes: KWOK)
    detail: str = ""  # why it failed or gave no figure; "" when it gave one

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "drivers", tuple(self.drivers))

    @property
    def took_s(self) -> float | None:
        return None if self.ended_wall_ns is None else (self.ended_wall_ns - self.started_wall_ns) / 1e9

    def line(self) -> str:
        pair = " <-> ".join(f"{n} ({d or 'driver ?'})" for n, d in zip(self.nodes, self.drivers))
        if self.busbw_gbps is not None and self.took_s is not None:
            result = f"{self.busbw_gbps:.2f} GB/s bus bandwidth in {self.took_s:.1f} s"
            return f"{self.when} all-reduce {pair}: {result} ({self.how})"
        return f"{self.when} all-reduce {pair}: {self.detail or 'no result'} ({self.how})"


# --- latency summaries -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencySummary:
    n: int
    min_s: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float

    def describe(self, what: str, clock: str = "client receive time") -> str:
        return (
            f"{what} p50 = {self.p50_s:.1f} s, p95 = {self.p95_s:.1f} s, p99 = {self.p99_s:.1f} s, "
            f"max = {self.max_s:.1f} s (n={self.n}; {clock})"
        )


def summarize(samples_s: Sequence[float]) -> LatencySummary | None:
    """Nearest-rank quantiles, so each is a real sample; None without samples."""
    ordered = sorted(samples_s)
    if not ordered:
        return None

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return LatencySummary(len(ordered), ordered[0], rank(0.50), rank(0.95), rank(0.99), ordered[-1])


# --- the result ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LadderResult:
    """The verdicts, the gate, and what the ladder computed on the way that the receipt draws."""

    verdicts: tuple[StageVerdict, ...]
    first_failed: Stage | None
    gate_passed: bool
    thresholds: Mapping[str, Any] = field(default_factory=dict, hash=False)  # Settings.thresholds()
    evictions: tuple[Eviction, ...] = ()
    phase_windows: tuple[PhaseWindow, ...] = ()  # of the first pool node, as the service load is cut
    state_spans: tuple[StateSpan, ...] = ()
    capacity: tuple[CapacityDip, ...] = ()  # per pool node
    stalls: tuple[Cause, ...] = ()  # per pool node, the cause that would not clear (rollout)

    def verdict(self, stage: Stage | str) -> StageVerdict:
        return next(v for v in self.verdicts if v.stage is Stage(stage))


def fails_gate(outcome: Outcome, settings: Settings) -> bool:
    """The gate's one predicate: a failed stage fails it, an inconclusive one unless --gpucanary-allow-inconclusive."""
    return outcome is Outcome.FAIL or (outcome is Outcome.INCONCLUSIVE and settings.inconclusive_fails)


def decide(verdicts: Sequence[StageVerdict], settings: Settings, **computed: Any) -> LadderResult:
    """The gate: first_failed is the earliest stage (ladder order) whose outcome fails the gate."""
    ordered = tuple(sorted(verdicts, key=lambda v: list(Stage).index(v.stage)))
    first = next((v.stage for v in ordered if fails_gate(v.outcome, settings)), None)
    return LadderResult(ordered, first, first is None, settings.thresholds(), **computed)
