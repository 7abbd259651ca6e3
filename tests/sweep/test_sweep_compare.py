"""Evict-and-restart, wait-for-completion and checkpoint-migrate costed on the same fleet."""

from __future__ import annotations

import pytest

from pytest_gpucanary.sweep.model import Fleet, Node, SweepLimits, VersionSet, Workload, parse_change
from pytest_gpucanary.sweep.compare import Strategy, compare_strategies

OLD = VersionSet(driver="570.172.08", cuda="12.8")
CHANGE = parse_change(["driver=580.95.05"], node_upgrade_s=900)
ONE_AT_A_TIME = SweepLimits(max_parallel=1, max_unavailable="1", hold_back_gpus=8)


def two_nodes(*, remaining_s: float | None = 3600.0) -> Fleet:
    """Node a runs a 2-GPU job (1 h of in-memory work), node b a 4-GPU one; a drains first (less loaded)."""
    return Fleet((Node("a", "H100", 8, OLD), Node("b", "H100", 8, OLD)),
                 (Workload("ja", "a", 2, OLD, restore_s=60, cold_start_s=600, since_start_s=3600,
                           remaining_s=remaining_s),
                  Workload("jb", "b", 4, OLD, restore_s=60, cold_start_s=600, since_start_s=0, remaining_s=1800)))


def by_strategy(fleet: Fleet) -> dict[Strategy, object]:
    return {c.strategy: c for c in compare_strategies(fleet, CHANGE, ONE_AT_A_TIME)}


def test_wait_for_completion_waits_for_the_longest_job_and_strands_the_rest() -> None:
    wait = by_strategy(two_nodes())[Strategy.WAIT_FOR_COMPLETION]
    # wave 1: a drains when ja ends (3600 s), back at 4500; wave 2: jb ended at 1800, so b is back at 5400
    assert wait.calendar_s == 5400
    assert (wait.lost_gpu_h, wait.cold_starts, wait.downtime_gpu_h) == (0.0, 0, 0.0)
    # a: 6 idle GPUs for 3600 s while ja finishes; both nodes: 8 GPUs for 900 s of upgrade
    assert wait.idle_gpu_h == pytest.approx((6 * 3600 + 2 * 8 * 900) / 3600)


def test_evict_and_restart_loses_the_in_memory_work_and_can_be_evicted_twice() -> None:
    evict = by_strategy(two_nodes())[Strategy.EVICT_RESTART]
    # ja restarts on b (no upgraded node yet) and is evicted again at 900 s, before it was ready (600 s
    # cold start at 0 -> ready 600; ran 300 s); jb is evicted at 900 s with 900 s of work
    assert evict.cold_starts == 3
    assert evict.lost_gpu_h == pytest.approx((2 * 3600 + 2 * 300 + 4 * 900) / 3600)
    assert evict.calendar_s == 2 * 900  # the last wave's upgrade ends after the last cold start (1500 s)


def test_checkpoint_migrate_keeps_the_work_until_the_crossing() -> None:
    cost = by_strategy(two_nodes())[Strategy.CHECKPOINT_MIGRATE]
    # ja restores onto held b at 0 (ready 60) and crosses at 900 with 3600 + 840 s of work; jb crosses at 900
    assert cost.cold_starts == 2
    assert cost.lost_gpu_h == pytest.approx((2 * (3600 + 840) + 4 * 900) / 3600)
    assert cost.calendar_s == 2 * 900


def test_work_that_never_ends_makes_the_wait_endless_and_says_who() -> None:
    wait = by_strategy(two_nodes(remaining_s=None))[Strategy.WAIT_FOR_COMPLETION]
    assert wait.calendar_s is None
    assert wait.note == "ja on a has no remaining_s; the drain waits for it forever"


def test_a_change_the_checkpoints_do_not_record_costs_no_work_and_no_cold_start() -> None:
    fleet = Fleet((Node("a", "H100", 8, OLD), Node("b", "H100", 8, OLD)),
                  (Workload("ja", "a", 2, VersionSet(driver="570.172.08"), since_start_s=3600),
                   Workload("jb", "b", 4, VersionSet(driver="570.172.08"), since_start_s=3600)))
    costs = {c.strategy: c for c in compare_strategies(fleet, parse_change(["cuda=13.0"]), ONE_AT_A_TIME)}
    assert (costs[Strategy.CHECKPOINT_MIGRATE].lost_gpu_h, costs[Strategy.CHECKPOINT_MIGRATE].cold_starts) == (0, 0)
    assert costs[Strategy.EVICT_RESTART].lost_gpu_h > 0 and costs[Strategy.EVICT_RESTART].cold_starts >= 2
