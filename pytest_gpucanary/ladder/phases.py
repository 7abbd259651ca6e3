"""Service SLO figures per upgrade phase: the load generator's samples cut by the pool node's
upgrade-state transitions.

Pure: takes recorded `Record`s and load `Sample`s, returns `PhaseStats` and rate points;
never talks to a cluster or starts load. Sample times are the load generator's wall clock at request
start; transitions are the recorder's client receive times (wall clock). Both are this host's clock,
so a request is placed by when it started, against when the recorder saw the label change.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pytest_gpucanary.ladder.model import PhaseStats, PhaseWindow, RatePoint, Sample, UpgradePhase, summarize
from pytest_gpucanary.ladder.timeline import Record, phase_windows


@dataclass(frozen=True)
class PhaseStart:
    phase: UpgradePhase
    start_wall_ns: int  # client receive time of the transition that began the phase


def phase_starts(records: Iterable[Record], node: str, *, since_wall_ns: int = 0) -> list[PhaseStart]:
    """Where each phase of the node's upgrade cycle begins (the cut of `phase_windows`); everything before
    the first is BEFORE."""
    return starts_of(phase_windows(records, node, since_wall_ns=since_wall_ns))


def starts_of(windows: Iterable[PhaseWindow]) -> list[PhaseStart]:
    """`phase_starts` of the node's phase windows."""
    starts = [PhaseStart(UpgradePhase.BEFORE, 0)]
    for window in windows:
        if window.phase is not starts[-1].phase:
            starts.append(PhaseStart(window.phase, window.start_wall_ns))
    return starts


def phase_of(t_ns: int, starts: Sequence[PhaseStart]) -> UpgradePhase:
    """The phase in force at `t_ns`: the last one that started at or before it (BEFORE if none)."""
    index = bisect.bisect_right([s.start_wall_ns for s in starts], t_ns) - 1
    return starts[index].phase if index >= 0 else UpgradePhase.BEFORE


def split_by_phase(samples: Iterable[Sample], starts: Sequence[PhaseStart]) -> dict[UpgradePhase, list[Sample]]:
    """Every sample in exactly one phase, by its start time; every phase present (maybe empty)."""
    split: dict[UpgradePhase, list[Sample]] = {phase: [] for phase in UpgradePhase}
    for sample in samples:
        split[phase_of(sample.t_ns, starts)].append(sample)  # a cycle has a handful of phase starts
    return split


def stats_of(phase: UpgradePhase, samples: Sequence[Sample]) -> PhaseStats:
    """Requests, failures and nearest-rank latency quantiles over all requests (n = requests)."""
    summary = summarize([s.latency_s for s in samples])
    return PhaseStats(
        phase=phase,
        requests=len(samples),
        failures=sum(not s.ok for s in samples),
        p50_s=summary.p50_s if summary else None,
        p95_s=summary.p95_s if summary else None,
        p99_s=summary.p99_s if summary else None,
    )


def phase_stats(
    samples: Iterable[Sample], records: Iterable[Record], node: str, *, since_wall_ns: int = 0
) -> tuple[PhaseStats, ...]:
    """One PhaseStats per upgrade phase, in ladder order; a phase without requests has n = 0 and no quantiles."""
    return stats_by_phase(samples, phase_starts(records, node, since_wall_ns=since_wall_ns))


def stats_by_phase(samples: Iterable[Sample], starts: Sequence[PhaseStart]) -> tuple[PhaseStats, ...]:
    """`phase_stats` cut at the phase starts given."""
    split = split_by_phase(samples, starts)
    return tuple(stats_of(phase, split[phase]) for phase in UpgradePhase)


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
    return [
        RatePoint(index * width_ns, bucket_s, *counts.get(index, (0, 0)))
        for index in range(min(counts), max(counts) + 1)
    ]
