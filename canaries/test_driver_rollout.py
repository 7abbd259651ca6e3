"""The shipped gate: one test per ladder stage of a canary driver rollout.

Run it with the policy under review and the target version, e.g.
    pytest canaries --gpucanary-policy policy.yaml --gpucanary-driver-version 580.95.05
Copy this directory and add tests of your own; `gpucanary_run.evidence` gives the recording and its queries,
`gpucanary_run.verdict(stage)` the ladder's verdicts.
The first line of every failure states the measured value, the threshold and the stage.
"""

from __future__ import annotations

import pytest


def assert_stage(run, stage: str) -> None:
    verdict = run.verdict(stage)
    if verdict.outcome.value == "skipped":
        pytest.skip(verdict.summary)
    if run.fails_gate(verdict):
        for item in verdict.evidence:       # the JUnit system-out: what the verdict rests on, a failing container's log
            at = f"+{item.offset_s:.0f}s" if item.offset_s is not None else "-"
            print(f"{at} {item.kind} {item.ref}: {item.text}")
        pytest.fail(verdict.summary, pytrace=False)


@pytest.mark.gpucanary("rollout")
def test_pool_reaches_upgrade_done_within_budget_touching_only_promised_pods(gpucanary_run) -> None:
    assert_stage(gpucanary_run, "rollout")


@pytest.mark.gpucanary("device")
def test_validators_ready_gpus_allocatable_and_driver_at_target(gpucanary_run) -> None:
    assert_stage(gpucanary_run, "device")


@pytest.mark.gpucanary("network")
def test_multi_node_collective_probe_completes(gpucanary_run) -> None:
    assert_stage(gpucanary_run, "network")


@pytest.mark.gpucanary("scheduler")
def test_probes_admitted_with_queue_delay_and_start_latency_in_bounds(gpucanary_run) -> None:
    assert_stage(gpucanary_run, "scheduler")


@pytest.mark.gpucanary("application")
def test_gpu_job_resumes_and_service_keeps_running_without_unexpected_evictions(gpucanary_run) -> None:
    assert_stage(gpucanary_run, "application")
