"""Plans a checkpoint-aware upgrade sweep wave by wave, through the placement engine (`sweep.engine`); pure,
no cluster.

How a plan is made (each assumption where it bites):

- Old nodes (a changed component not yet at its target) are swept; nodes already current are not.
- Per old (GPU model, version set), the most loaded nodes holding at least `hold_back_gpus` GPUs are
  held back and drain after every other old node. The rest drain least loaded first. A wave takes
  `wave_size` nodes in that order.
- Wave k starts at (k - 1) * node_upgrade_s, when the previous wave's nodes are back. Draining is
  taken as instant (the checkpoint dump is counted in restore_s), and no new work arrives.
- Each workload on a draining node, largest first:
  1. restores where its checkpoint is valid: an upgraded node first, then a held node, then the old
     node that drains latest (old nodes only for work leaving a node that is not held);
  2. if its checkpoint restores only on the old set, it leaves a node that is not held, and nodes of
     that set still stand but none has room: no plan (`no-old-capacity`);
  3. otherwise it cold-starts on the new stack (its node's versions with the change applied, same
     GPU model): on an upgraded node, or else on one of this wave's nodes once that is back; a
     workload whose checkpoint restores there restores instead. Nothing fits: `no-new-capacity`.
- A cold start destroys the in-memory work since the workload last started (since_start_s plus the
  time it ran in the plan; a restore carries it along); that work is redone, so a finite workload's
  end moves out by it. A restore or cold start cut short by the next drain counts only the part done.
- A workload whose remaining_s runs out before its node drains finishes in place and frees its GPUs.
"""

from __future__ import annotations

from pytest_gpucanary.sweep.engine import HELD, WAIT, Engine, Step
from pytest_gpucanary.sweep.model import (
    Change,
    CheckpointFate,
    Fleet,
    Infeasible,
    MoveKind,
    NoSweepPlanError,
    Shortfall,
    ShortfallKind,
    SweepLimits,
    SweepPlan,
    VersionSet,
    Wave,
)


class CheckpointMigrate:
    """Checkpoint, then restore on compatible capacity; cross to the new stack by one cold start."""

    def now(self, e: Engine, w: int, src: int) -> Step:
        new_pools, old_pools = e.restore_pools(w)
        leaving_held = e.tier[src] == HELD
        node = e.find(new_pools if leaving_held else new_pools + old_pools, e.workloads[w].gpus)
        if node >= 0:
            return Step(node, MoveKind.RESTORE)
        if not leaving_held and e.fates[w] is CheckpointFate.OLD_SET_ONLY and any(p.standing for p in old_pools):
            return Step(-1, None, ShortfallKind.NO_OLD_CAPACITY)
        if new_pools:
            return WAIT
        node = e.find(e.cold_pool(src), e.workloads[w].gpus)
        return Step(node, MoveKind.COLD_START) if node >= 0 else WAIT

    def later(self, e: Engine, w: int, src: int) -> Step:
        new_pools, _ = e.restore_pools(w)
        node = e.find(new_pools, e.workloads[w].gpus)
        if node >= 0:
            return Step(node, MoveKind.RESTORE)
        node = e.find(e.cold_pool(src), e.workloads[w].gpus)
        return Step(node, MoveKind.COLD_START)


def plan_sweep(fleet: Fleet, change: Change, limits: SweepLimits) -> SweepPlan:
    """The checkpoint-migrate plan, or NoSweepPlanError saying which workloads have nowhere to go."""
    outcome = plan_or_infeasible(fleet, change, limits)
    if isinstance(outcome, Infeasible):
        raise NoSweepPlanError(outcome)
    return outcome


def plan_or_infeasible(fleet: Fleet, change: Change, limits: SweepLimits) -> SweepPlan | Infeasible:
    """Like `plan_sweep`, with "no plan" as a record for callers that report it as data."""
    engine = Engine(fleet, change, limits)
    waves, shortfalls = engine.run(CheckpointMigrate())
    if shortfalls:
        return Infeasible(change, limits, _grouped(shortfalls), _hold_back_fix(fleet, change, limits))
    return summarize(engine, waves)


def summarize(e: Engine, waves: list[Wave]) -> SweepPlan:
    """The plan record of a finished run: waves plus totals (idle = upgrading nodes + restores and cold starts)."""
    moves = [m for wave in waves for m in wave.moves]
    upgrade_gpu_s = sum(e.fleet.nodes[i].gpus for wave in e.waves for i in wave) * e.change.node_upgrade_s
    duration = max([waves[-1].end_s if waves else 0.0] + [m.ready_s for m in moves])
    return SweepPlan(
        change=e.change,
        limits=e.limits,
        wave_size=e.wave_size,
        waves=tuple(waves),
        cold_starts=sum(m.kind is MoveKind.COLD_START for m in moves),
        restores=sum(m.kind is MoveKind.RESTORE for m in moves),
        duration_s=duration,
        lost_gpu_h=e.lost_gpu_s / 3600,
        downtime_gpu_h=e.downtime_gpu_s / 3600,
        idle_gpu_h=(upgrade_gpu_s + e.busy_gpu_s) / 3600,
    )


def _grouped(shortfalls: list[Shortfall]) -> tuple[Shortfall, ...]:
    groups: dict[tuple, list[Shortfall]] = {}
    for s in shortfalls:
        groups.setdefault((s.wave, s.kind, s.gpu_model, s.versions), []).append(s)
    return tuple(
        Shortfall(
            s[0].wave,
            s[0].kind,
            s[0].gpu_model,
            s[0].versions,
            tuple(x for one in s for x in one.workloads),
            sum(one.gpus for one in s),
        )
        for s in groups.values()
    )


def _hold_back_fix(fleet: Fleet, change: Change, limits: SweepLimits) -> int | None:
    """Smallest hold-back found by bisection that yields a plan; None if holding back everything fails.

    The answer is rounded up to whole nodes: to the largest value that holds back the same nodes.
    """
    groups: dict[tuple[str, VersionSet], list[int]] = {}
    for n in fleet.nodes:
        if not change.is_current(n.versions):
            groups.setdefault((n.gpu_model, n.versions), []).append(n.gpus)
    low, high = limits.hold_back_gpus, max((sum(g) for g in groups.values()), default=0)

    def works(hold_back: int) -> Engine | None:
        engine = Engine(fleet, change, SweepLimits(limits.max_parallel, limits.max_unavailable, hold_back))
        return None if engine.run(CheckpointMigrate())[1] else engine

    if high <= low or not works(high):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if works(middle) else (middle, high)
    engine = works(high)
    assert engine is not None  # high always works: checked above, and the bisection keeps it so
    held: dict[tuple[str, VersionSet], int] = {}
    for i, n in enumerate(fleet.nodes):
        if engine.tier[i] == HELD:
            held[(n.gpu_model, n.versions)] = held.get((n.gpu_model, n.versions), 0) + n.gpus
    return min((h for h in held.values() if h >= high), default=high)
