"""Three ways to sweep the same fleet, costed side by side; pure, no cluster.

All three use the same waves (the planner's node order and wave size) and the same clock: wave k
starts when wave k - 1's nodes are back from their upgrade, and no new work arrives during the sweep.
What each strategy costs:

- calendar_s: plan-clock seconds from the first drain to the last workload running again (or, for
  wait-for-completion, to the last node back); None when the sweep never ends.
- lost_gpu_h: in-memory work destroyed and redone, GPU-hours.
- cold_starts: workloads started from nothing.
- idle_gpu_h: GPU capacity standing idle because of the sweep: every swept node's GPUs for
  node_upgrade_s, GPUs held by a workload while it restores or cold-starts, and (wait-for-completion)
  GPUs on a draining node that no job uses while the node waits for its longest job.
- downtime_gpu_h: GPU-hours of workload demand not running between stop and ready.

Assumptions per strategy:

- evict-and-restart (a Kubernetes drain): every GPU pod is evicted and loses its in-memory work since
  it last started. Its controller recreates it at once; the scheduler is taken to prefer the new stack
  (the best case for this strategy), else any standing old node of the same set, where the pod will
  be evicted again, else it waits for this wave's nodes. Every restart is a cold start.
- wait-for-completion (a Slurm drain): a node takes no new work and is upgraded once its longest
  job ends (remaining_s); nothing is lost and nothing restarts (what follows a finished job starts on
  the new stack as new work). A workload without remaining_s never ends, so the sweep never does.
- checkpoint-migrate: the planner's plan (see `sweep.plan`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pytest_gpucanary.sweep.engine import WAIT, Engine, Step
from pytest_gpucanary.sweep.model import Change, Fleet, Infeasible, MoveKind, NoSweepPlanError, SweepLimits, SweepPlan
from pytest_gpucanary.sweep.plan import plan_or_infeasible, summarize


class Strategy(enum.StrEnum):
    EVICT_RESTART = "evict-and-restart"
    WAIT_FOR_COMPLETION = "wait-for-completion"
    CHECKPOINT_MIGRATE = "checkpoint-migrate"


@dataclass(frozen=True, slots=True)
class StrategyCost:
    strategy: Strategy
    calendar_s: float | None
    lost_gpu_h: float
    cold_starts: int
    idle_gpu_h: float
    downtime_gpu_h: float
    note: str = ""


class EvictRestart:
    """Evicted pods restart cold: on the new stack if it has room, else wherever their set still stands."""

    def now(self, e: Engine, w: int, src: int) -> Step:
        gpus = e.workloads[w].gpus
        node = e.find(e.cold_pool(src), gpus)
        if node < 0:
            node = e.find(e.same_set_pools(src), gpus)
        return Step(node, MoveKind.COLD_START) if node >= 0 else WAIT

    def later(self, e: Engine, w: int, src: int) -> Step:
        return Step(e.find(e.cold_pool(src), e.workloads[w].gpus), MoveKind.COLD_START)


def compare_strategies(
    fleet: Fleet, change: Change, limits: SweepLimits, *, outcome: SweepPlan | Infeasible | None = None
) -> tuple[StrategyCost, ...]:
    """The three costs; pass the checkpoint-migrate `outcome` if it is already planned."""
    if outcome is None:
        outcome = plan_or_infeasible(fleet, change, limits)
    return (
        evict_restart_cost(fleet, change, limits),
        wait_for_completion_cost(fleet, change, limits),
        checkpoint_migrate_cost(outcome),
    )


def _from_plan(strategy: Strategy, plan: SweepPlan) -> StrategyCost:
    return StrategyCost(
        strategy, plan.duration_s, plan.lost_gpu_h, plan.cold_starts, plan.idle_gpu_h, plan.downtime_gpu_h
    )


def checkpoint_migrate_cost(outcome: SweepPlan | Infeasible) -> StrategyCost:
    if isinstance(outcome, Infeasible):
        note = str(NoSweepPlanError(outcome))
        return StrategyCost(Strategy.CHECKPOINT_MIGRATE, None, 0.0, 0, 0.0, 0.0, note=note)
    return _from_plan(Strategy.CHECKPOINT_MIGRATE, outcome)


def evict_restart_cost(fleet: Fleet, change: Change, limits: SweepLimits) -> StrategyCost:
    engine = Engine(fleet, change, limits)
    waves, shortfalls = engine.run(EvictRestart())
    if shortfalls:
        first = shortfalls[0]
        note = f"wave {first.wave}: {first.workloads[0]} finds no room on the new stack"
        return StrategyCost(Strategy.EVICT_RESTART, None, 0.0, 0, 0.0, 0.0, note=note)
    return _from_plan(Strategy.EVICT_RESTART, summarize(engine, waves))


def wait_for_completion_cost(fleet: Fleet, change: Change, limits: SweepLimits) -> StrategyCost:
    engine = Engine(fleet, change, limits)
    on_node: dict[str, list] = {}
    for w in fleet.workloads:
        on_node.setdefault(w.node, []).append(w)
    t = idle_gpu_s = 0.0
    for wave in engine.waves:
        back = t
        for n in wave:
            node = fleet.nodes[n]
            jobs = on_node.get(node.name, [])
            endless = [w.name for w in jobs if w.remaining_s is None]
            if endless:
                note = f"{endless[0]} on {node.name} has no remaining_s; the drain waits for it forever"
                return StrategyCost(Strategy.WAIT_FOR_COMPLETION, None, 0.0, 0, 0.0, 0.0, note=note)
            drained = max([t] + [w.remaining_s for w in jobs])
            busy_gpu_s = sum(w.gpus * max(0.0, w.remaining_s - t) for w in jobs)
            idle_gpu_s += node.gpus * (drained - t) - busy_gpu_s + node.gpus * change.node_upgrade_s
            back = max(back, drained + change.node_upgrade_s)
        t = back
    return StrategyCost(Strategy.WAIT_FOR_COMPLETION, t, 0.0, 0, idle_gpu_s / 3600, 0.0)
