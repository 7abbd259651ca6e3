"""Per-phase service stats and rate series: worked examples on a canned upgrade cycle, then invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpucanary.ladder.model import Sample
from pytest_gpucanary.ladder.phases import PhaseStart, phase_of, phase_starts, phase_stats, rate_series, split_by_phase
from pytest_gpucanary.canary.recorder import Record
from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder.model import PHASE_OF_STATE, UpgradePhase

T0 = 1_767_000_000 * 10**9
NODE = "canary-0"
HAPPY = ["upgrade-required", "cordon-required", "wait-for-jobs-required", "pod-deletion-required",
         "pod-restart-required", "validation-required", "uncordon-required", "upgrade-done"]


def at(offset_s: float) -> int:
    return T0 + int(offset_s * 1e9)


def node(offset_s: float, state: str, *, name: str = NODE) -> Record:
    obj = {"metadata": {"name": name, "labels": {UPGRADE_STATE_LABEL: state} if state else {}}}
    return Record("nodes", "MODIFIED", "Node", None, name, at(offset_s), at(offset_s), obj)


def cycle(states: list[str], *, start_s: float = 10.0, step_s: float = 10.0) -> list[Record]:
    return [node(0, "upgrade-done")] + [node(start_s + i * step_s, s) for i, s in enumerate(states)]


def sample(offset_s: float, latency_s: float = 0.01, status: int = 200) -> Sample:
    return Sample(at(offset_s), latency_s, 200 <= status < 400, status)


def test_a_happy_cycle_cuts_four_phases_at_its_transitions() -> None:
    records = cycle(HAPPY)  # upgrade-required at +10, cordon +20, restart +50, done +80
    starts = phase_starts(records, NODE)
    assert [(s.phase, s.start_wall_ns) for s in starts] == [
        (UpgradePhase.BEFORE, 0), (UpgradePhase.DRAIN, at(20)), (UpgradePhase.RESTART, at(50)),
        (UpgradePhase.AFTER, at(80))]
    assert phase_of(at(19.9), starts) is UpgradePhase.BEFORE
    assert phase_of(at(20), starts) is UpgradePhase.DRAIN           # a transition starts its phase
    assert phase_of(at(79.9), starts) is UpgradePhase.RESTART
    assert phase_of(at(500), starts) is UpgradePhase.AFTER


def test_the_state_before_the_cycle_is_before_even_when_it_reads_upgrade_done() -> None:
    starts = phase_starts([node(0, "upgrade-done")], NODE)
    assert starts == [PhaseStart(UpgradePhase.BEFORE, 0)]
    stats = phase_stats([sample(1), sample(2)], [node(0, "upgrade-done")], NODE)
    assert [(s.phase, s.requests) for s in stats] == [(UpgradePhase.BEFORE, 2), (UpgradePhase.DRAIN, 0),
                                                      (UpgradePhase.RESTART, 0), (UpgradePhase.AFTER, 0)]
    assert stats[1].p99_s is None


def test_a_cycle_before_since_is_ignored() -> None:
    records = cycle(HAPPY) + [node(200, "upgrade-required"), node(210, "drain-required")]
    starts = phase_starts(records, NODE, since_wall_ns=at(150))
    assert [(s.phase, s.start_wall_ns) for s in starts] == [(UpgradePhase.BEFORE, 0), (UpgradePhase.DRAIN, at(210))]


def test_phase_stats_count_failures_and_latency_per_phase() -> None:
    records = cycle(HAPPY)
    samples = ([sample(5, 0.010 + i / 1000) for i in range(100)]
               + [sample(30, 0.002, 503) for _ in range(10)] + [sample(30, 0.5)]
               + [sample(90, 0.02)])
    before, drain, restart, after = phase_stats(samples, records, NODE)
    assert (before.requests, before.failures) == (100, 0)
    assert (before.p50_s, before.p95_s, before.p99_s) == (pytest.approx(0.059), pytest.approx(0.104),
                                                          pytest.approx(0.108))
    assert (drain.requests, drain.failures, drain.p99_s) == (11, 10, 0.5)
    assert (restart.requests, restart.p50_s) == (0, None)
    assert (after.requests, after.failures, after.p50_s) == (1, 0, 0.02)


def test_requestor_mode_states_stay_in_the_phase_they_occur_in() -> None:
    records = cycle(["upgrade-required", "cordon-required", "node-maintenance-required", "pod-restart-required"])
    starts = phase_starts(records, NODE)
    assert [s.phase for s in starts] == [UpgradePhase.BEFORE, UpgradePhase.DRAIN, UpgradePhase.RESTART]


def test_rate_series_fills_gaps_and_counts_errors() -> None:
    samples = [sample(0.1), sample(0.2, status=503), sample(3.5)]
    points = rate_series(samples)
    assert [(p.requests, p.errors) for p in points] == [(2, 1), (0, 0), (0, 0), (1, 0)]
    assert points[0].start_wall_ns == at(0) and points[1].start_wall_ns - points[0].start_wall_ns == 10**9
    assert rate_series([]) == []
    halves = rate_series(samples, bucket_s=0.5)
    assert halves[0].requests_per_s == 4.0 and halves[0].errors_per_s == 2.0
    with pytest.raises(ValueError):
        rate_series(samples, bucket_s=0)


# --- invariants ---------------------------------------------------------------------------------------

states = st.sampled_from(sorted(PHASE_OF_STATE) + ["node-maintenance-required"])
transitions = st.lists(st.tuples(st.integers(0, 300), states), max_size=12)
load = st.lists(st.tuples(st.integers(-50, 400), st.floats(0, 30, allow_nan=False), st.sampled_from([200, 0, 503])),
                max_size=200)


def _records(pairs: list[tuple[int, str]]) -> list[Record]:
    return [node(t, s) for t, s in sorted(pairs, key=lambda p: p[0])]


@settings(max_examples=300, deadline=None)
@given(transitions, load, st.integers(0, 300))
def test_every_sample_lands_in_exactly_one_phase(pairs, raw, since_s) -> None:
    samples = [sample(t, latency, status) for t, latency, status in raw]
    records = _records(pairs)
    split = split_by_phase(samples, phase_starts(records, NODE, since_wall_ns=at(since_s)))
    assert list(split) == list(UpgradePhase)
    assert sorted(id(s) for part in split.values() for s in part) == sorted(id(s) for s in samples)
    stats = phase_stats(samples, records, NODE, since_wall_ns=at(since_s))
    assert sum(s.requests for s in stats) == len(samples)
    assert sum(s.failures for s in stats) == sum(not s.ok for s in samples)


@settings(max_examples=300, deadline=None)
@given(transitions, load)
def test_quantiles_are_ordered_real_samples_with_their_n(pairs, raw) -> None:
    samples = [sample(t, latency, status) for t, latency, status in raw]
    split = split_by_phase(samples, phase_starts(_records(pairs), NODE))
    for stats in phase_stats(samples, _records(pairs), NODE):
        latencies = [s.latency_s for s in split[stats.phase]]
        assert stats.requests == len(latencies)
        if not latencies:
            assert (stats.p50_s, stats.p95_s, stats.p99_s) == (None, None, None)
            continue
        assert min(latencies) <= stats.p50_s <= stats.p95_s <= stats.p99_s <= max(latencies)
        assert {stats.p50_s, stats.p95_s, stats.p99_s} <= set(latencies)


@settings(max_examples=200, deadline=None)
@given(load, st.sampled_from([0.25, 1.0, 5.0]))
def test_rate_series_keeps_every_request(raw, bucket_s) -> None:
    samples = [sample(t, latency, status) for t, latency, status in raw]
    points = rate_series(samples, bucket_s)
    assert sum(p.requests for p in points) == len(samples)
    assert sum(p.errors for p in points) == sum(not s.ok for s in samples)
    assert all(b.start_wall_ns > a.start_wall_ns for a, b in zip(points, points[1:]))
