"""The sweep planner: one worked example per row of the restore table, then invariants under hypothesis."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.sweep.model import (
    Change, CheckpointFate, Component, Fleet, MoveKind, Node, NoSweepPlanError, ShortfallKind, SweepLimits,
    SweepPlan, VersionSet, Workload, checkpoint_fate, parse_change, restores_on,
)
from pytest_gpucanary.sweep.plan import plan_sweep

OLD = VersionSet(driver="570.172.08", cuda="12.8", engine="vllm-0.10.1", model="llama-70b@1")
NEW_VALUE = {Component.DRIVER: "580.95.05", Component.CUDA: "13.0", Component.ENGINE: "vllm-0.11.0",
             Component.MODEL: "llama-70b@2"}


def three_nodes(checkpoint: VersionSet | None = OLD) -> Fleet:
    """Three 8-GPU H100 nodes on OLD, one 2-GPU workload on each."""
    nodes = tuple(Node(f"n{i}", "H100", 8, OLD) for i in (1, 2, 3))
    workloads = tuple(Workload(f"w{i}", f"n{i}", 2, checkpoint, restore_s=60, cold_start_s=1200) for i in (1, 2, 3))
    return Fleet(nodes, workloads)


ONE_AT_A_TIME = SweepLimits(max_parallel=1, max_unavailable="1", hold_back_gpus=8)


def moves_of(plan: SweepPlan, workload: str) -> list[tuple[MoveKind, str, str, float]]:
    return [(m.kind, m.from_node, m.to_node, m.start_s) for w in plan.waves for m in w.moves if m.workload == workload]


@pytest.mark.parametrize("component", [Component.DRIVER, Component.CUDA, Component.ENGINE])
def test_stack_change_restores_on_the_old_set_then_crosses_by_one_cold_start(component: Component) -> None:
    change = parse_change([f"{component}={NEW_VALUE[component]}"])
    assert checkpoint_fate(OLD, change) is CheckpointFate.OLD_SET_ONLY
    assert restores_on(OLD, OLD, change) and not restores_on(OLD, change.apply(OLD), change)

    plan = plan_sweep(three_nodes(), change, ONE_AT_A_TIME)

    assert [w.nodes for w in plan.waves] == [("n1",), ("n2",), ("n3",)]  # n3 is held back: it drains last
    assert moves_of(plan, "w1") == [(MoveKind.RESTORE, "n1", "n3", 0.0), (MoveKind.COLD_START, "n3", "n1", 1800.0)]
    assert moves_of(plan, "w3") == [(MoveKind.COLD_START, "n3", "n1", 1800.0)]  # best fit packs n1
    assert plan.cold_starts == 3 and plan.restores == 2
    assert [w.old_gpus_left for w in plan.waves] == [16, 8, 0]


def test_model_change_cold_starts_on_the_new_version_without_a_restore() -> None:
    change = parse_change([f"model={NEW_VALUE[Component.MODEL]}"])
    assert checkpoint_fate(OLD, change) is CheckpointFate.NEW_VERSION_COLD_START
    assert not restores_on(OLD, OLD, change)  # invalid even where the node still has the old model

    plan = plan_sweep(three_nodes(), change, ONE_AT_A_TIME)

    assert plan.restores == 0 and plan.cold_starts == 3
    # nothing is upgraded yet in wave 1, so w1 waits for its own node to come back on the new version
    assert moves_of(plan, "w1") == [(MoveKind.COLD_START, "n1", "n1", 900.0)]
    assert moves_of(plan, "w2") == [(MoveKind.COLD_START, "n2", "n1", 900.0)]


def test_change_to_nothing_recorded_restores_anywhere_and_never_cold_starts() -> None:
    change = parse_change([f"driver={NEW_VALUE[Component.DRIVER]}"])
    no_driver = VersionSet(cuda="12.8", model="llama-70b@1")  # e.g. a job that records no driver
    assert checkpoint_fate(no_driver, change) is CheckpointFate.RESTORES_ANYWHERE

    plan = plan_sweep(three_nodes(no_driver), change, ONE_AT_A_TIME)

    assert plan.cold_starts == 0 and plan.lost_gpu_h == 0.0
    assert moves_of(plan, "w2") == [(MoveKind.RESTORE, "n2", "n1", 900.0)]  # onto the upgraded n1


def test_restore_never_crosses_gpu_models() -> None:
    nodes = (Node("h1", "H100", 8, OLD), Node("h2", "H100", 8, OLD), Node("a1", "A100", 8, OLD))
    fleet = Fleet(nodes, (Workload("w", "h1", 8, OLD), Workload("x", "h2", 8, OLD)))
    with pytest.raises(NoSweepPlanError) as caught:
        plan_sweep(fleet, parse_change(["driver=580.95.05"]), SweepLimits(1, "1", 0))
    [short] = caught.value.infeasible.shortfalls
    # a1 (empty) drains first; in wave 2 it has 8 free GPUs on either version, and w still has nowhere to go
    assert (short.wave, short.kind, short.gpu_model, short.workloads) == (2, ShortfallKind.NO_OLD_CAPACITY, "H100", ("w",))


def test_no_plan_says_which_workloads_at_which_wave_and_the_hold_back_that_fixes_it() -> None:
    change = parse_change(["driver=580.95.05"])
    limits = SweepLimits(max_parallel=1, max_unavailable="1", hold_back_gpus=0)
    fleet = Fleet(tuple(Node(f"n{i}", "H100", 8, OLD) for i in range(4)),
                  tuple(Workload(f"w{i}", f"n{i % 4}", 2, OLD) for i in range(8)))
    with pytest.raises(NoSweepPlanError) as caught:
        plan_sweep(fleet, change, limits)
    infeasible = caught.value.infeasible
    assert infeasible.shortfalls[0].wave == 3 and infeasible.shortfalls[0].gpus == 8
    assert infeasible.hold_back_fix_gpus == 16
    assert "hold back 16 GPUs" in str(caught.value) and "\n" not in str(caught.value)
    plan = plan_sweep(fleet, change, dataclasses.replace(limits, hold_back_gpus=16))
    assert plan.cold_starts == 8


def test_work_that_ends_before_its_node_drains_frees_its_gpus_and_never_moves() -> None:
    fleet = Fleet((Node("n1", "H100", 8, OLD), Node("n2", "H100", 8, OLD)),
                  (Workload("done-soon", "n2", 4, OLD, remaining_s=100.0), Workload("w", "n1", 2, OLD)))
    plan = plan_sweep(fleet, parse_change(["driver=580.95.05"]), SweepLimits(1, "1", 8))
    assert plan.waves[1].finished == ("done-soon",)
    assert moves_of(plan, "done-soon") == []


def test_nodes_already_on_the_target_are_not_swept() -> None:
    current = dataclasses.replace(OLD, driver="580.95.05")
    fleet = Fleet((Node("old", "H100", 8, OLD), Node("cur", "H100", 8, current)), (Workload("w", "old", 2, OLD),))
    plan = plan_sweep(fleet, parse_change(["driver=580.95.05"]), SweepLimits(1, "1", 0))
    assert [w.nodes for w in plan.waves] == [("old",)]
    assert moves_of(plan, "w") == [(MoveKind.COLD_START, "old", "cur", 0.0)]


@pytest.mark.parametrize(("limits", "nodes", "size"), [
    (SweepLimits(max_parallel=0, max_unavailable="25%"), 9, 3),   # a percentage rounds up
    (SweepLimits(max_parallel=2, max_unavailable="25%"), 9, 2),
    (SweepLimits(max_parallel=0, max_unavailable="1%"), 9, 1),
    (SweepLimits(max_parallel=5, max_unavailable="100%"), 3, 3),
])
def test_wave_size_is_the_tighter_limit(limits: SweepLimits, nodes: int, size: int) -> None:
    assert limits.wave_size(nodes) == size


@pytest.mark.parametrize("bad", [["kernel=6.8"], ["driver"], ["driver="], []])
def test_a_bad_change_is_a_config_error(bad: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_change(bad)


@pytest.mark.parametrize("bad", [{"max_unavailable": "0"}, {"max_unavailable": "lots"}, {"max_parallel": -1},
                                 {"hold_back_gpus": -8}])
def test_bad_limits_are_config_errors(bad: dict) -> None:
    with pytest.raises(ConfigError):
        SweepLimits(**bad)


# --- invariants -------------------------------------------------------------------------------------------

SETS = (OLD, dataclasses.replace(OLD, driver="575.57.08"), dataclasses.replace(OLD, cuda="12.9", engine="sglang-0.5"))
INVALIDATED = {CheckpointFate.OLD_SET_ONLY, CheckpointFate.NEW_VERSION_COLD_START, CheckpointFate.NO_CHECKPOINT}


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Fleet, Change, SweepLimits]:
    nodes = [Node(f"n{i}", draw(st.sampled_from(["H100", "A100"])), draw(st.sampled_from([1, 2, 4, 8])),
                  draw(st.sampled_from(SETS))) for i in range(draw(st.integers(1, 9)))]
    workloads = []
    for node in nodes:
        free = node.gpus
        for j in range(draw(st.integers(0, 3))):
            if free == 0:
                break
            gpus = draw(st.integers(1, free))
            free -= gpus
            checkpoint = draw(st.sampled_from([None, node.versions, VersionSet(cuda=node.versions.cuda), SETS[0]]))
            workloads.append(Workload(
                f"{node.name}-w{j}", node.name, gpus, checkpoint, restore_s=draw(st.floats(1, 120)),
                cold_start_s=draw(st.floats(1, 2000)), since_start_s=draw(st.floats(0, 1e5)),
                remaining_s=draw(st.none() | st.floats(0, 5000))))
    components = draw(st.lists(st.sampled_from(list(Component)), min_size=1, max_size=4, unique=True))
    values = {c: draw(st.sampled_from([NEW_VALUE[c], SETS[1].get(c), SETS[2].get(c)])) for c in components}
    change = Change(VersionSet(**{c.value: v for c, v in values.items()}), node_upgrade_s=draw(st.floats(1, 1000)))
    limits = SweepLimits(draw(st.integers(0, 4)), draw(st.sampled_from(["1", "2", "25%", "50%", "100%"])),
                         draw(st.integers(0, 24)))
    return Fleet(tuple(nodes), tuple(workloads)), change, limits


def replay(fleet: Fleet, change: Change, limits: SweepLimits, plan: SweepPlan) -> dict[str, int]:
    """Walks the plan from the inventory, asserting every invariant; returns cold starts per workload."""
    nodes = {n.name: n for n in fleet.nodes}
    work = {w.name: w for w in fleet.workloads}
    where = {w.name: w.node for w in fleet.workloads}
    used = {n: 0 for n in nodes}
    for w in fleet.workloads:
        used[w.node] += w.gpus
    upgraded: set[str] = set()
    cold = {w: 0 for w in work}
    for wave in plan.waves:
        assert 1 <= len(wave.nodes) <= limits.wave_size(len(nodes))
        assert limits.max_parallel == 0 or len(wave.nodes) <= limits.max_parallel
        for name in wave.finished:
            used[where.pop(name)] -= work[name].gpus
        draining = set(wave.nodes)
        assert not draining & upgraded and all(not change.is_current(nodes[n].versions) for n in draining)
        assert {m.workload for m in wave.moves} == {w for w, n in where.items() if n in draining}
        for m in wave.moves:
            used[m.from_node] -= work[m.workload].gpus
        for m in wave.moves:
            assert m.stop_s == wave.start_s <= m.start_s <= m.ready_s and m.lost_gpu_s >= 0
            w, to = work[m.workload], nodes[m.to_node]
            assert to.gpu_model == nodes[w.node].gpu_model
            back = m.start_s > wave.start_s
            assert (m.to_node in draining) <= back
            versions = change.apply(to.versions) if m.to_node in upgraded or back else to.versions
            if m.kind is MoveKind.RESTORE:
                assert restores_on(w.checkpoint, versions, change)
            else:
                assert versions == change.apply(nodes[m.from_node].versions)
                cold[m.workload] += 1
            used[m.to_node] += w.gpus
            assert used[m.to_node] <= to.gpus
            where[m.workload] = m.to_node
        upgraded |= draining
    for name, node in where.items():
        assert change.is_current(nodes[node].versions) or node in upgraded
    assert all(change.is_current(n.versions) or n.name in upgraded for n in fleet.nodes)
    return cold


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plans_keep_every_invariant(scenario: tuple[Fleet, Change, SweepLimits]) -> None:
    fleet, change, limits = scenario
    try:
        plan = plan_sweep(fleet, change, limits)
        event("planned")
    except NoSweepPlanError as err:
        infeasible = err.infeasible
        assert infeasible.shortfalls and all(s.workloads and s.gpus > 0 for s in infeasible.shortfalls)
        event(f"no plan; fix found: {infeasible.hold_back_fix_gpus is not None}")
        if infeasible.hold_back_fix_gpus is None:
            return
        plan = plan_sweep(fleet, change, limits := dataclasses.replace(limits, hold_back_gpus=infeasible.hold_back_fix_gpus))
    cold = replay(fleet, change, limits, plan)
    assert min(plan.lost_gpu_h, plan.idle_gpu_h, plan.downtime_gpu_h) >= 0
    nodes = {n.name: n for n in fleet.nodes}
    finished = {name for wave in plan.waves for name in wave.finished}
    for w in fleet.workloads:
        fate = checkpoint_fate(w.checkpoint, change)
        assert cold[w.name] <= 1
        if w.name in finished or change.is_current(nodes[w.node].versions):
            continue
        if fate in INVALIDATED and not moved_only_by_restore_then_finished(plan, w.name):
            assert cold[w.name] == 1, w
        if fate is CheckpointFate.RESTORES_ANYWHERE and restores_on(w.checkpoint, nodes[w.node].versions, change):
            assert cold[w.name] == 0, w


def moved_only_by_restore_then_finished(plan: SweepPlan, workload: str) -> bool:
    """A restored workload can end on the old set before it has to cross; it then never cold-starts."""
    return any(workload in wave.finished for wave in plan.waves)
