"""A drain that a PodDisruptionBudget refuses, on the session fleet's KWOK pool with the real operator,
scheduler, eviction API and disruption controller: the run names the budget and the pod it guards once
the drain's own timeout has passed, and the cluster is left as it was.

(The kubelet pool's cases of a driver that cannot come, no image and a driver held by a pod that asked
for no GPU, are in test_kubelet_pool.py; each cause's rules are unit-tested in tests/ladder/test_stall.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpucanary.kube import Kube
from harness import FAST, KEEP_FLEET, TARGET, assert_nothing_left, gpucanary, receipt_of, refused_drain_options

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
DRAIN_TIMEOUT_S = 60


def test_a_budget_that_refuses_the_drain_fails_at_rollout_naming_it(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:
    policy, service = refused_drain_options(tmp_path, drain_timeout_s=DRAIN_TIMEOUT_S)
    result = gpucanary("run", policy, f"--gpucanary-driver-version={TARGET}", *FAST, service,
                       env=KEEP_FLEET, reports=tmp_path / "reports")

    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 1, output
    receipt = receipt_of(tmp_path / "reports")
    assert receipt["first_failed"] == "rollout", output
    [rollout] = [v for v in receipt["verdicts"] if v["stage"] == "rollout"]
    summary = rollout["summary"]
    assert "/sched-api-" in summary and "drain cannot evict it: PodDisruptionBudget gpucanary-" in summary, summary
    assert "/sched-api allows 0 disruptions" in summary, summary
    # the refusal reached the progress as it happened, before the drain gave up
    assert any("] rollout: pod gpucanary-" in line and "EvictionRefused" in line
               for line in result.stdout.splitlines()), output
    assert_nothing_left(kube, policy_before)
