"""The ladder on canned timelines shaped like what the recorder captures during real upgrades, then invariants."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpucanary.canary import recorder
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.label_selector import parse_selector
from pytest_gpucanary.ladder import (
    MetricCheck, Outcome, PhaseStats, ProbeSeen, RunEvidence, Stage, StageVerdict, decide, evaluate,
    evictions, summarize,
)
from pytest_gpucanary.ladder.model import CollectiveRun, UpgradePhase
from pytest_gpucanary.ladder import jobs
from pytest_gpucanary.ladder.network import check_network
from pytest_gpucanary.ladder.rollout import check_rollout
from pytest_gpucanary.ladder.scheduler import check_scheduler
from pytest_gpucanary.ladder.timeline import phase_windows

from canned_runs import (  # tests/canned_runs.py
    T0, OLD, NEW, NODE, DRAIN_FALLBACK_MESSAGE, HAPPY, at, node, pod, states, operands, workloads, probes, run, clean_run, field_note_run, rdma_run,
)



def outcomes(evidence: RunEvidence, settings: Settings = Settings()) -> dict[Stage, Outcome]:
    return {v.stage: v.outcome for v in evaluate(evidence, settings).verdicts}


def test_clean_upgrade_passes_every_stage_and_skips_network_with_the_reason() -> None:
    result = evaluate(clean_run())
    assert {v.stage: v.outcome for v in result.verdicts} == {
        Stage.ROLLOUT: Outcome.PASS, Stage.DEVICE: Outcome.PASS, Stage.NETWORK: Outcome.SKIPPED,
        Stage.SCHEDULER: Outcome.PASS, Stage.APPLICATION: Outcome.PASS}
    assert result.gate_passed and result.first_failed is None
    assert result.verdict(Stage.NETWORK).summary == (
        "network: no GPU networking configured on the 1-node pool (no nvidia-peermem, nvidia-fs or MOFED driver pod, "
        "no RDMA or SR-IOV resource)")
    assert result.verdict(Stage.ROLLOUT).summary.startswith("rollout: 1/1 pool nodes reached upgrade-done, slowest at "
                                                            "+135s <= budget 1200 s")
    assert "judged on evictions only" in result.verdict(Stage.APPLICATION).summary
    assert "1 allowed eviction(s)" in result.verdict(Stage.APPLICATION).summary


def test_field_note_non_gpu_pod_evicted_by_drain_fails_application_with_the_exact_line() -> None:
    result = evaluate(field_note_run())
    application = result.verdict(Stage.APPLICATION)
    assert application.outcome is Outcome.FAIL
    assert application.summary == ("application: non-GPU pod default/sched-api-7f9c evicted by drain at +212s "
                                   "(allowed: GPU pods only)")
    assert result.first_failed is Stage.APPLICATION and not result.gate_passed
    assert [v.outcome for v in result.verdicts[:4]] == [Outcome.PASS, Outcome.PASS, Outcome.SKIPPED, Outcome.PASS]
    texts = [e.text for e in result.verdict(Stage.ROLLOUT).evidence]
    assert f"Warning GPUDriverUpgrade: {DRAIN_FALLBACK_MESSAGE}" in texts


def test_a_selector_can_allow_the_drained_service_and_gpu_evictions_before_drain_are_by_pod_deletion() -> None:
    found = evictions(field_note_run(), Settings(allowed_evictions="app in (gpu-job,sched-api)"))
    assert [(e.name, e.by_drain, e.allowed) for e in found] == [("train-a1", True, True),
                                                                ("sched-api-7f9c", True, True)]
    clean = evictions(clean_run())
    assert [(e.name, e.by_drain, e.disruption_reason) for e in clean] == [("train-a1", False, "EvictionByEvictionAPI")]
    result = evaluate(clean_run(), Settings(allowed_evictions="app!=gpu-job"))
    assert result.verdict(Stage.APPLICATION).summary.startswith(
        "application: GPU pod default/train-a1 evicted by pod deletion at +20s (allowed: pods matching app!=gpu-job)")


def test_missing_records_are_inconclusive_and_fail_the_gate() -> None:
    result = evaluate(run([], probes=()))
    assert {v.stage: v.outcome for v in result.verdicts} == {
        Stage.ROLLOUT: Outcome.INCONCLUSIVE, Stage.DEVICE: Outcome.INCONCLUSIVE, Stage.NETWORK: Outcome.SKIPPED,
        Stage.SCHEDULER: Outcome.INCONCLUSIVE, Stage.APPLICATION: Outcome.INCONCLUSIVE}
    assert result.first_failed is Stage.ROLLOUT and not result.gate_passed
    assert result.verdict(Stage.ROLLOUT).summary == f"rollout: no Node records for pool node {NODE}"


def test_inconclusive_does_not_fail_the_gate_when_told_so() -> None:
    result = evaluate(clean_run(probes=probes(2)), Settings(allow_inconclusive=True))
    assert result.verdict(Stage.SCHEDULER).outcome is Outcome.INCONCLUSIVE
    assert result.gate_passed and result.first_failed is None


def test_upgrade_failed_fails_rollout_naming_the_state_sequence() -> None:
    schedule = list(zip([5, 10, 12, 14, 60], HAPPY[:4] + ["upgrade-failed"]))
    result = evaluate(run(states(schedule) + operands(restart_s=1000) + workloads(evicted_at_s=1000)))
    assert result.first_failed is Stage.ROLLOUT
    assert result.verdict(Stage.ROLLOUT).summary == (
        "rollout: node canary-0 reached upgrade-failed at +60s via upgrade-required -> cordon-required -> "
        "wait-for-jobs-required -> pod-deletion-required -> upgrade-failed: podDeletion failed after 46 s "
        "(expected upgrade-done within budget 1200 s)")
    assert result.verdict(Stage.DEVICE).outcome is Outcome.INCONCLUSIVE


NO_EMPTYDIR_DELETION = {"podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": False},
                        "drain": {"enable": False, "force": False, "timeoutSeconds": 300, "deleteEmptyDir": False}}


def test_upgrade_failed_says_why_a_shm_emptydir_stopped_gpu_pod_deletion() -> None:
    shm_job = pod(-40, "default", "train-a1", labels={"job-name": "train"}, gpus=1, owner="Job", image="pytorch")
    shm_job.object["spec"]["emptyDirs"] = ["dshm"]
    schedule = list(zip([5, 10, 12, 14, 15], HAPPY[:4] + ["upgrade-failed"]))
    result = evaluate(run(states(schedule) + [shm_job], upgrade_policy=NO_EMPTYDIR_DELETION))
    assert result.first_failed is Stage.ROLLOUT
    assert result.verdict(Stage.ROLLOUT).summary.endswith(
        "-> upgrade-failed: podDeletion refused GPU pod default/train-a1 with emptyDir dshm "
        "(podDeletion.deleteEmptyDir=false) (expected upgrade-done within budget 1200 s)")


def test_upgrade_failed_after_the_pod_deletion_timeout_blames_what_held_the_pods() -> None:
    schedule = list(zip([5, 10, 12, 14, 315], HAPPY[:4] + ["upgrade-failed"]))
    result = evaluate(run(states(schedule) + workloads(evicted_at_s=1000), upgrade_policy=NO_EMPTYDIR_DELETION))
    assert "podDeletion gave up after 301 s (podDeletion.timeoutSeconds=300; a PodDisruptionBudget" in \
        result.verdict(Stage.ROLLOUT).summary


def test_rollout_without_a_terminal_state_fails_only_once_the_budget_has_passed() -> None:
    schedule = list(zip([5, 10, 12], HAPPY[:3]))
    short = run(states(schedule) + [node(300, "wait-for-jobs-required")])
    assert check_rollout(short).outcome is Outcome.INCONCLUSIVE
    assert "when the recording ended at +300s" in check_rollout(short).summary
    long = run(states(schedule) + [node(1300, "wait-for-jobs-required")])
    assert check_rollout(long).outcome is Outcome.FAIL
    late = list(zip([5, 10, 12, 14, 26, 90, 130, 1250], HAPPY))
    assert check_rollout(run(states(late))).summary == ("rollout: node canary-0 reached upgrade-done at +1250s > "
                                                        "budget 1200 s")


def test_rollout_says_whether_the_driver_pod_was_restarted_in_place_or_fully_upgraded() -> None:
    full = check_rollout(clean_run()).summary
    assert full.endswith("(client receive time); full upgrade (pod deletion, no drain)")
    # as v26.7 did on the fleet: cordoned without a cordon-required label, straight to pod-restart-required
    restart_only = list(zip([5, 5.1, 130, 131, 135], ["upgrade-required", "pod-restart-required",
                                                      "validation-required", "uncordon-required", "upgrade-done"]))
    summary = check_rollout(run(states(restart_only))).summary
    assert summary.endswith("; driver pod restarted in place (restart-only: no wait for jobs, pod deletion or drain)")
    assert "full upgrade (with drain)" in check_rollout(field_note_run()).summary
    served = tuple(PhaseStats(p, 1000, 0, 0.02, 0.05, 0.1) for p in ("before", "restart", "after"))
    in_place = run(states(restart_only) + operands() + workloads(evicted_at_s=1000), service_phases=served)
    application = evaluate(in_place).verdict(Stage.APPLICATION)
    assert "phase drain" not in application.summary
    assert any("phase drain not passed" in e.text for e in application.evidence)
    cut_short = run(states(restart_only[:2]) + operands() + workloads(evicted_at_s=1000), service_phases=served)
    unfinished = evaluate(cut_short).verdict(Stage.APPLICATION)        # no end state yet: every phase is judged
    assert not any("not passed" in e.text for e in unfinished.evidence) and unfinished.outcome is not Outcome.PASS


def test_probes_below_min_samples_are_inconclusive() -> None:
    verdict = check_scheduler(clean_run(probes=probes(2)), Settings())
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.summary == "scheduler: pool probe queue delay n=2 < min 3 samples (+1 more inconclusive)"


def test_scheduler_reports_the_slowest_pool_probe_against_its_threshold() -> None:
    verdict = check_scheduler(clean_run(probes=probes(6, queue_delay_s=131.0)), Settings(max_queue_delay_s=120))
    assert verdict.summary == ("scheduler: pool probe queue delay p100 = 131.0 s (n=6; client receive time) "
                               "> 120 s")
    stats = [e.text for e in verdict.evidence if e.kind == "ProbeStats"]
    assert stats[0] == ("pool probe queue delay p50 = 131.0 s, p95 = 131.0 s, p99 = 131.0 s, max = 131.0 s "
                        "(n=6; client receive time)")


def test_a_probe_that_never_started_fails_naming_it() -> None:
    stuck = ProbeSeen("fleet-9", "fleet", at(40), None, None, None)
    verdict = check_scheduler(clean_run(probes=probes() + (stuck,)))
    assert verdict.outcome is Outcome.FAIL
    assert verdict.summary.startswith("scheduler: fleet probe fleet-9 never running (created at +40s;")


def test_a_probe_evicted_before_it_ran_is_over_not_in_flight() -> None:
    """The drain evicts a pool probe's pod before it runs; its Job (backoffLimit 0) makes no other. The run
    must not wait for it to run (the settle step waited out its bound for exactly this), and the
    scheduler names it with when its pod ended."""
    job = {"job-name": "probe-pool-0000"}
    records = [pod(0, "ns", "probe-pool-0000-8w7jb", labels=job, phase="Pending", kind_type="ADDED"),
               pod(1.3, "ns", "probe-pool-0000-8w7jb", labels=job, phase="Failed", removing=True,
                   disruption="EvictionByEvictionAPI"),
               pod(2.4, "ns", "probe-pool-0000-8w7jb", labels=job, phase="Failed", removing=True,
                   kind_type="DELETED"),
               pod(3, "ns", "probe-fleet-0000-x1", labels={"job-name": "probe-fleet-0000"}, node_name="gpu-2")]
    seen = jobs.probes_seen(records, {"probe-pool-0000": ("pool", at(0)), "probe-fleet-0000": ("fleet", at(0))},
                                namespace="ns")
    assert [(p.name, p.running_wall_ns, p.ended_wall_ns) for p in seen] == [
        ("probe-fleet-0000", at(3), None), ("probe-pool-0000", None, at(1.3))]
    assert all(p.running_wall_ns or p.ended_wall_ns for p in seen)        # what the settle step waits for
    evicted = ProbeSeen("fleet-8", "fleet", at(40), at(41), None, "gpu-2", at(45))
    verdict = check_scheduler(clean_run(probes=probes() + (evicted,)))
    assert verdict.summary.startswith("scheduler: fleet probe fleet-8 never running (created at +40s; its pod "
                                      "ended unstarted at +45s)")


def test_device_fails_on_a_driver_still_at_the_old_version_and_folds_in_metric_checks() -> None:
    schedule = list(zip([5, 10, 12, 14, 26, 90, 130, 135], HAPPY))
    stale = run(states(schedule) + operands(driver_tag=f"{OLD}-ubuntu22.04") + workloads())
    assert evaluate(stale).verdict(Stage.DEVICE).summary == (
        f"device: driver pod gpu-operator/driver-canary-0-new on canary-0 runs tag {OLD}-ubuntu22.04, expected a tag "
        f"starting {NEW}")
    unreachable = MetricCheck("dcgm_driver_version", Stage.DEVICE, Outcome.INCONCLUSIVE, None, "Prometheus unreachable")
    result = evaluate(clean_run(metric_checks=(unreachable,)))
    assert result.verdict(Stage.DEVICE).outcome is Outcome.INCONCLUSIVE
    assert result.first_failed is Stage.DEVICE


def test_device_fails_when_gpu_allocatable_is_not_restored() -> None:
    schedule = list(zip([5, 10, 12, 14, 26, 90, 130, 135], HAPPY))
    records = states(schedule) + operands() + workloads() + [node(200, "upgrade-done", gpus="7")]
    assert evaluate(run(records)).verdict(Stage.DEVICE).summary == (
        "device: node canary-0 allocatable nvidia.com/gpu = 7 after upgrade-done, expected 8 (before the upgrade)")


def test_device_passes_on_a_validator_and_device_plugin_ready_after_the_new_driver_and_reports_the_gpu_dip() -> None:
    result = evaluate(clean_run())
    device = result.verdict(Stage.DEVICE)
    assert device.outcome is Outcome.PASS
    assert device.summary == (f"device: 1/1 pool nodes: driver {NEW} Ready, then validator and device plugin Ready; "
                              "GPUs gone at most 104 s, all back by +130s (<= 900 s)")
    [dip] = result.capacity
    assert (dip.before, dip.lowest, dip.left_s, dip.back_s, dip.gone_s, dip.after) == (8, 0, 26.0, 130.0, 104.0, 8)
    assert dip.series[0] == (-60.0, 8) and (26.0, 0) in dip.series and (130.0, 8) in dip.series


def test_device_fails_on_a_validator_that_was_ready_only_before_the_new_driver_giving_both_times() -> None:
    schedule = list(zip([5, 10, 12, 14, 26, 90, 130, 135], HAPPY))
    stale = run(states(schedule) + operands(validator_after=False) + workloads() + [node(500, "upgrade-done")])
    assert evaluate(stale).verdict(Stage.DEVICE).summary == (
        "device: validator pod gpu-operator/validator-canary-0-old on canary-0 was Ready at -50.0s, before the new "
        "driver pod driver-canary-0-new at +60.0s: it checked the old driver, and none was Ready after")


def test_device_fails_when_the_gpus_stay_gone_longer_than_allowed() -> None:
    summary = evaluate(clean_run(), Settings(max_gpus_gone_s=60)).verdict(Stage.DEVICE).summary
    assert summary == "device: node canary-0's GPUs were gone from allocatable for 104 s > 60 s"


def test_a_node_held_in_validation_required_names_its_unready_validator_at_rollout_and_device() -> None:
    schedule = list(zip([5, 10, 12, 14, 26, 90], HAPPY[:6]))
    stuck = pod(80, "gpu-operator", "validator-canary-0-new", labels={"app": "nvidia-operator-validator"},
                phase="Pending", owner="DaemonSet")
    records = states(schedule) + operands(validator_after=False)[:-1] + [
        pod(27, "gpu-operator", "validator-canary-0-old", labels={"app": "nvidia-operator-validator"}, removing=True,
            owner="DaemonSet"), stuck, node(1300, "validation-required", gpus="8")]
    result = evaluate(run(records))
    assert result.first_failed is Stage.ROLLOUT
    line = ("validator pod gpu-operator/validator-canary-0-new is Pending, 0/0 containers ready since +80s (the "
            "operator fails the node after its 600 s validation timeout)")
    assert result.verdict(Stage.ROLLOUT).summary == (
        f"rollout: node canary-0 in validation-required at +1300s, no upgrade-done within budget 1200 s ({line})")
    assert result.verdict(Stage.DEVICE).summary == f"device: node canary-0 held in validation-required: {line}"


def test_a_node_without_any_validator_pod_says_the_operator_never_times_it_out() -> None:
    schedule = list(zip([5, 10, 12, 14, 26, 90], HAPPY[:6]))
    records = [r for r in states(schedule) + operands() if "validator" not in (r.name or "")]
    summary = evaluate(run(records + [node(1300, "validation-required")])).verdict(Stage.ROLLOUT).summary
    assert summary.endswith("(no app=nvidia-operator-validator pod on canary-0: the operator waits in "
                            "validation-required without ever starting its validation timeout)")


def test_service_phases_fail_naming_the_phase_and_value() -> None:
    phases = tuple(PhaseStats(p, 1000, 0, 0.02, 0.05, 0.1) for p in ("before", "after", "restart")) + (
        PhaseStats("drain", 1000, 40, 0.02, 0.4, 0.9),)
    verdict = evaluate(clean_run(service_phases=phases)).verdict(Stage.APPLICATION)
    assert verdict.summary == ("application: service default/sched-api error ratio 0.040 in phase drain "
                               "(40/1000 requests) > 0.01")
    missing = evaluate(clean_run(service_phases=phases[:2])).verdict(Stage.APPLICATION)
    assert missing.outcome is Outcome.INCONCLUSIVE


def test_gpu_job_that_never_finishes_fails() -> None:
    records = [r for r in clean_run().records if not (r.name == "train-b2" and r.received_wall_ns >= at(150))]
    verdict = evaluate(run(records)).verdict(Stage.APPLICATION)
    assert verdict.outcome is Outcome.FAIL
    assert verdict.summary.startswith("application: GPU job default/train did not finish "
                                      "(train-a1 Running, train-b2 Pending")


def test_a_gpu_job_done_before_pod_deletion_leaves_the_policy_untried_and_is_inconclusive() -> None:
    """The field note's policy passes unseen when the job has ended before the node gets to pod deletion:
    nothing for pod deletion to refuse, no drain, no eviction."""
    done = pod(12, "default", "train-a1", labels={"job-name": "train"}, gpus=1, owner="Job", phase="Succeeded",
               ready=False)
    records = [r for r in clean_run().records if not r.name.startswith("train-")] + [
        pod(-40, "default", "train-a1", labels={"job-name": "train"}, gpus=1, owner="Job"), done]
    verdict = evaluate(run(records)).verdict(Stage.APPLICATION)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.summary == ("application: GPU job default/train was not running when canary-0 reached "
                               "pod-deletion-required at +14s (train-a1 Succeeded): the policy's GPU pod deletion "
                               "was not tried on it; give it a longer --gpucanary-job-duration-s")
    # a policy that waits for the job by a pod selector asks for exactly that
    waits = {"waitForCompletion": {"podSelector": "job-name=train", "timeoutSeconds": 0}}
    assert evaluate(run(records, upgrade_policy=waits)).verdict(Stage.APPLICATION).outcome is Outcome.PASS


def test_network_is_skipped_without_gpu_networking_and_judges_a_collective_probe_when_given() -> None:
    two = clean_run(pool_nodes=(NODE, "canary-1"))
    assert check_network(two).outcome is Outcome.SKIPPED
    ok = MetricCheck("nccl_allreduce", Stage.NETWORK, Outcome.PASS, 180.0, "bus bandwidth GB/s >= 150")
    assert check_network(dataclasses.replace(two, metric_checks=(ok,))).outcome is Outcome.PASS




def test_network_on_one_node_checks_peermem_and_the_rdma_devices_came_back() -> None:
    verdict = check_network(rdma_run())
    assert verdict.outcome is Outcome.PASS
    assert verdict.summary == ("network: 1/1 pool nodes: GPUDirect RDMA (nvidia-peermem) back, "
                               "rdma/rdma_shared_device_a back after the driver swap; no collective probe")
    assert check_network(rdma_run(peermem_ready_after=False)).summary == (
        "network: GPUDirect RDMA (nvidia-peermem): container nvidia-peermem-ctr of driver pod driver-canary-0-new on "
        "canary-0 is not ready after the driver swap")
    assert check_network(rdma_run(rdma_after="0")).summary == (
        "network: node canary-0 allocatable rdma/rdma_shared_device_a = 0 after the upgrade, expected 63 (before)")


def test_a_configured_multi_node_pool_without_its_collective_probe_is_inconclusive() -> None:
    two = dataclasses.replace(rdma_run(), pool_nodes=(NODE,))
    assert check_network(two).outcome is Outcome.PASS
    records = rdma_run().records
    both = run(list(records) + [dataclasses.replace(r, name="canary-1", object={**r.object, "metadata": {
        **r.object["metadata"], "name": "canary-1"}}) for r in records if r.kind == "Node"], pool_nodes=(NODE, "canary-1"))
    assert check_network(both).summary.startswith("network: no collective probe result for the 2-node pool (n=0)")


def test_timeline_loaded_from_jsonl_gives_the_same_verdicts(tmp_path: Path) -> None:
    evidence = field_note_run()
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in evidence.records) + '{"torn":')
    loaded = dataclasses.replace(evidence, records=tuple(recorder.load(path)))
    assert evaluate(loaded) == evaluate(evidence)


def test_phase_windows_cut_the_cycle_into_before_drain_restart_after() -> None:
    windows = phase_windows(clean_run().records, NODE, since_wall_ns=T0)
    assert [(w.phase, (w.start_wall_ns - T0) / 1e9) for w in windows] == [
        (UpgradePhase.BEFORE, -60.0), (UpgradePhase.DRAIN, 10.0), (UpgradePhase.RESTART, 26.0),
        (UpgradePhase.AFTER, 135.0)]


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ("app=a", {"app": "a"}, True), ("app==a", {"app": "b"}, False), ("app!=a", {}, True),
    ("app in (a, b),tier!=control", {"app": "b", "tier": "web"}, True), ("app notin (a,b)", {"app": "a"}, False),
    ("gpu", {"gpu": ""}, True), ("!gpu", {"gpu": "1"}, False), ("app in (gpu-job),tier!=control",
                                                                  {"app": "gpu-job", "tier": "control"}, False)])
def test_label_selectors(selector: str, labels: dict, expected: bool) -> None:
    assert all(req(labels) for req in parse_selector(selector)) is expected


@pytest.mark.parametrize("bad", ["app in a", "=x", "app=a,,b=c", ""])
def test_bad_selector_is_a_config_error_with_the_accepted_forms(bad: str) -> None:
    with pytest.raises(ConfigError, match="key in"):
        Settings(allowed_evictions=bad)


def test_ladder_and_receipt_import_neither_kubernetes_nor_kube() -> None:
    code = ("import sys, pytest_gpucanary.ladder, pytest_gpucanary.receipt;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('kubernetes', 'pytest') or m.endswith('.kube')];"
            "sys.exit(str(bad) if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- properties ----------------------------------------------------------------------------------------

@given(st.lists(st.floats(min_value=0, max_value=1e5, allow_nan=False), min_size=1, max_size=200))
def test_quantiles_are_ordered_and_carry_n(samples: list[float]) -> None:
    stats = summarize(samples)
    assert stats is not None and stats.n == len(samples)
    assert stats.min_s <= stats.p50_s <= stats.p95_s <= stats.p99_s <= stats.max_s
    assert stats.p50_s in samples and stats.max_s == max(samples)


verdicts_strategy = st.lists(st.sampled_from(list(Outcome)), min_size=5, max_size=5).map(
    lambda outs: [StageVerdict(stage, outcome, f"{stage.value}: x") for stage, outcome in zip(Stage, outs)])


@given(verdicts_strategy, st.booleans(), st.randoms())
def test_first_failed_is_the_earliest_stage_that_did_not_pass(verdicts: list[StageVerdict], strict: bool,
                                                              rng) -> None:
    shuffled = list(verdicts)
    rng.shuffle(shuffled)
    result = decide(shuffled, Settings(allow_inconclusive=not strict))
    failing = {Outcome.FAIL} | ({Outcome.INCONCLUSIVE} if strict else set())
    earliest = next((v.stage for v in verdicts if v.outcome in failing), None)
    assert result.first_failed is earliest
    assert result.gate_passed is (earliest is None)
    assert [v.stage for v in result.verdicts] == list(Stage)


@settings(max_examples=80, deadline=None)
@given(drop=st.sets(st.sampled_from(["Node", "Pod", "Event"])), end_s=st.floats(min_value=-60, max_value=600),
       n_probes=st.integers(min_value=0, max_value=2), nodes=st.integers(min_value=1, max_value=3),
       metric=st.sampled_from([None, Outcome.INCONCLUSIVE, Outcome.SKIPPED]))
def test_missing_evidence_is_never_pass(drop: set[str], end_s: float, n_probes: int, nodes: int,
                                        metric: Outcome | None) -> None:
    """Drop whole kinds of records, end the recording early, give too few probes or a second node without a
    collective probe: the stages that lost their evidence are never PASS."""
    evidence = clean_run(probes=probes(n_probes), pool_nodes=tuple(f"canary-{i}" for i in range(nodes)),
                         metric_checks=() if metric is None else (
                             MetricCheck("m", Stage.NETWORK, metric, None, "probe"),))
    records = tuple(r for r in evidence.records if r.kind not in drop and r.received_wall_ns <= at(end_s))
    got = outcomes(dataclasses.replace(evidence, records=records))
    assert got[Stage.SCHEDULER] is not Outcome.PASS
    assert got[Stage.NETWORK] is not Outcome.PASS
    upgrade_unseen = "Node" in drop or end_s < 135 or nodes > 1       # upgrade-done at +135 on canary-0 only
    blind = {Stage.ROLLOUT} if upgrade_unseen else set()
    blind |= {Stage.DEVICE} if upgrade_unseen or "Pod" in drop else set()
    blind |= {Stage.APPLICATION} if "Pod" in drop or end_s < 150 else set()   # the GPU job resumes at +150
    assert all(got[stage] is not Outcome.PASS for stage in blind), got


def test_an_upgrade_done_from_before_the_start_does_not_count_but_a_pending_upgrade_required_does() -> None:
    stale = run(states([(-50, "upgrade-required"), (-40, "upgrade-done")]) + [node(300, "upgrade-done")])
    verdict = check_rollout(stale)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert "never entered upgrade-required (last state upgrade-done)" in verdict.summary
    already = list(zip([-5, 10, 12, 14, 26, 90, 130, 135], HAPPY))
    assert check_rollout(run(states(already))).outcome is Outcome.PASS


def _collective(when: str, *, bw: float | None, start: float, took: float | None = 6.0, detail: str = "") -> CollectiveRun:
    return CollectiveRun(when, (NODE, "gpu-peer"), ("550.90.07" if when == "after" else "535.183.01", "535.183.01"),
                         at(start), None if took is None else at(start + took), bw, "simulated", detail)


def test_network_holds_the_collective_probe_after_the_swap_against_its_baseline() -> None:
    base = _collective("baseline", bw=24.0, start=-20)
    with_probe = dataclasses.replace(rdma_run(), collective=(base, _collective("after", bw=23.0, start=250)))
    verdict = check_network(with_probe)
    assert verdict.outcome is Outcome.PASS
    assert verdict.summary.endswith("after the driver swap; collective probe 23.00 GB/s after vs 24.00 GB/s "
                                    "baseline (canary-0 <-> gpu-peer, simulated)")
    collective = [e for e in verdict.evidence if e.kind == "Collective"]
    assert [e.offset_s for e in collective] == [-20.0, 250.0]
    assert collective[1].text == ("after all-reduce canary-0 (550.90.07) <-> gpu-peer (535.183.01): 23.00 GB/s bus "
                                  "bandwidth in 6.0 s (simulated)")

    slow = dataclasses.replace(with_probe, collective=(base, _collective("after", bw=12.0, start=250)))
    assert check_network(slow).summary == (
        "network: collective probe canary-0 <-> gpu-peer after the driver swap: bus bandwidth 12.00 GB/s, below 80% "
        "of the baseline 24.00 GB/s")
    hung = dataclasses.replace(with_probe, collective=(base, _collective(
        "after", bw=None, took=None, start=250, detail="did not complete within 30 s of starting")))
    assert check_network(hung).outcome is Outcome.FAIL
    assert check_network(hung).summary == (
        "network: collective probe canary-0 <-> gpu-peer after the driver swap: did not complete within 30 s of "
        "starting (baseline 24.00 GB/s)")
    no_base = dataclasses.replace(with_probe, collective=(_collective("baseline", bw=None, took=None, start=-20,
                                                                      detail="not both ranks started within 600 s"),))
    assert check_network(no_base).outcome is Outcome.INCONCLUSIVE
    assert "no baseline figure" in check_network(no_base).summary
    never_back = dataclasses.replace(with_probe, collective=(base,))
    assert check_network(never_back).summary.startswith("network: collective probe: no run after the upgrade")


def test_a_lost_peermem_leads_the_network_verdict_before_the_probe_it_broke() -> None:
    broken = dataclasses.replace(rdma_run(peermem_ready_after=False), collective=(
        _collective("baseline", bw=24.0, start=-20),
        _collective("after", bw=None, took=None, start=250, detail="did not complete within 30 s of starting")))
    assert check_network(broken).summary.startswith(
        "network: GPUDirect RDMA (nvidia-peermem): container nvidia-peermem-ctr of driver pod driver-canary-0-new on "
        "canary-0 is not ready after the driver swap (+1 more fail)")
