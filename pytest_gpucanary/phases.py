"""Service SLO figures per upgrade phase: the load generator's samples cut by the pool node's
upgrade-state transitions.

Pure: takes recorded `Record`s and load `Sample`s, returns `ladder.PhaseStats` and rate points;
never talks to a cluster or starts load. Sample times are the load generator's wall clock at request
start; transitions are the recorder's client receive times (wall clock). Both are this host's clock,
so a request is placed by when it started, against when the recorder saw the label change.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from pytest_gpucanary import timeline
from pytest_gpucanary.ladder import PhaseStats, summarize
from pytest_gpucanary.timeline import PHASE_OF_STATE, UpgradePhase

if TYPE_CHECKING:
    from pytest_gpucanary.load import Sample
    from pytest_gpucanary.recorder import Record


@dataclass(frozen=True)
class PhaseStart:
    phase: UpgradePhase
    start_wall_ns: int            # client receive time of the transition that began the phase


def phase_starts(records: Iterable[Record], node: str, *, since_wall_ns: int = 0) -> list[PhaseStart]:
    """Where each phase of the node's upgrade cycle begins; everything before the first is BEFORE.

    The cycle starts when the node enters upgrade-required at or after `since_wall_ns`. States outside
    the table (the operator's requestor mode) keep the phase they occur in."""
    starts = [PhaseStart(UpgradePhase.BEFORE, 0)]
    for t in timeline.upgrade_cycle(records, node, since_wall_ns=since_wall_ns):
        phase = PHASE_OF_STATE.get(t.state, starts[-1].phase)
        if phase is not starts[-1].phase:
            starts.append(PhaseStart(phase, t.received_wall_ns))
    return starts


def phase_of(t_ns: int, starts: Sequence[PhaseStart]) -> UpgradePhase:
    """The phase in force at `t_ns`: the last one that started at or before it (BEFORE if none)."""
    index = bisect.bisect_right([s.start_wall_ns for s in starts], t_ns) - 1
    return starts[index].phase if index >= 0 else UpgradePhase.BEFORE


def split_by_phase(samples: Iterable[Sample], starts: Sequence[PhaseStart]) -> dict[UpgradePhase, list[Sample]]:
    """Every sample in exactly one phase, by its start time; every phase present (maybe empty)."""
    split: dict[UpgradePhase, list[Sample]] = {phase: [] for phase in UpgradePhase}
    for sample in samples:
        split[phase_of(sample.t_ns, starts)].append(sample)   # a cycle has a handful of phase starts
    return split


def stats_of(phase: UpgradePhase, samples: Sequence[Sample]) -> PhaseStats:
    """Requests, failures and nearest-rank latency quantiles over all requests (n = requests)."""
    summary = summarize([s.latency_s for s in samples])
    return PhaseStats(phase=phase, requests=len(samples), failures=sum(not s.ok for s in samples),
                      p50_s=summary.p50_s if summary else None, p95_s=summary.p95_s if summary else None,
                      p99_s=summary.p99_s if summary else None)


def phase_stats(samples: Iterable[Sample], records: Iterable[Record], node: str, *,
                since_wall_ns: int = 0) -> tuple[PhaseStats, ...]:
    """One PhaseStats per upgrade phase, in ladder order; a phase without requests has n = 0 and no quantiles."""
    split = split_by_phase(samples, phase_starts(records, node, since_wall_ns=since_wall_ns))
    return tuple(stats_of(phase, split[phase]) for phase in UpgradePhase)


@dataclass(frozen=True)
class RatePoint:
    start_wall_ns: int            # bucket start, a multiple of the bucket width (load generator's wall clock)
    bucket_s: float
    requests: int
    errors: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.bucket_s

    @property
    def errors_per_s(self) -> float:
        return self.errors / self.bucket_s


def rate_series(samples: Iterable[Sample], bucket_s: float = 1.0) -> list[RatePoint]:
    """Requests and errors per bucket by request start time, from the first bucket to the last; a bucket
    without requests is a zero, so a stalled load generator shows as a gap, not as nothing."""
    if not bucket_s > 0:
        raise ValueError(f"bucket_s must be > 0, not {bucket_s!r}")
    width_ns = max(1, round(bucket_s * 1e9))
    counts: dict[int, list[int]] = {}
    for sample in samples:
        bucket = counts.setdefault(sample.t_ns // width_ns, [0, 0])
        bucket[0] += 1
        bucket[1] += not sample.ok
    if not counts:
        return []
    return [RatePoint(index * width_ns, bucket_s, *counts.get(index, (0, 0)))
            for index in range(min(counts), max(counts) + 1)]
