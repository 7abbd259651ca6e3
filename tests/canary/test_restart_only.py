"""A change that leaves the driver as it is (the pool's driver pods relabelled, the version kept), on the
real controllers of two releases at once: v26.7 (the session fleet) restarts the driver pod in place
without evicting anything, v25.10.1 (a one-node fleet of its own) takes the full path and its pod
deletion evicts the GPU job. Each receipt says which.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest
from harness import FAST, FLEET_DRIVER, KEEP_FLEET, gpucanary, second_fleet_env, session_fleet_env

from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OLDER_RELEASE = "v25.10.1"


@pytest.fixture(scope="module")
def older_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = second_fleet_env("restart-only", tmp_path_factory.mktemp("v25-fleet"), gpucanary_fleet,
                           GPUCANARY_FLEET_GPU_NODES="1", GPUCANARY_FLEET_KUBELET_NODES="0",
                           GPUCANARY_OPERATOR_RELEASE=OLDER_RELEASE,
                           GPUCANARY_OPERATOR_BIN_DIR="")     # the cached build of the release, built if missing
    up = gpucanary("fleet", "up", env={**KEEP_FLEET, **env})
    assert up.returncode == 0, up.stderr[-3000:]
    yield env
    gpucanary("fleet", "down", env={**KEEP_FLEET, **env})


@pytest.fixture(scope="module")
def same_version_runs(gpucanary_fleet, older_fleet: dict[str, str], tmp_path_factory) -> dict[str, tuple]:
    session = session_fleet_env(gpucanary_fleet)

    def run(env: dict[str, str], name: str) -> tuple[subprocess.CompletedProcess[str], dict]:
        reports = tmp_path_factory.mktemp(name)
        result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                           f"--gpucanary-driver-version={FLEET_DRIVER}", *FAST, "--gpucanary-load-users=4",
                           f"--gpucanary-reports-dir={reports}", env={**KEEP_FLEET, **env})
        receipts = list(reports.glob("*/receipt.json"))
        return result, json.loads(receipts[0].read_text()) if receipts else {}

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {"v26.7": pool.submit(run, session, "v267"), OLDER_RELEASE: pool.submit(run, older_fleet, "v25")}
        return {release: future.result() for release, future in futures.items()}


def verdict(receipt: dict, stage: str) -> str:
    return next(v["summary"] for v in receipt["verdicts"] if v["stage"] == stage)


def test_v26_7_restarts_the_driver_pod_in_place_and_evicts_nothing(same_version_runs) -> None:
    result, receipt = same_version_runs["v26.7"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "release v26.7.0" in result.stdout
    assert "; driver pod restarted in place (restart-only: no wait for jobs, pod deletion or drain)" in \
        verdict(receipt, "rollout"), receipt["verdicts"]
    assert receipt["evictions"] == []
    assert "(1 pod(s), 0 evicted)" in verdict(receipt, "application")
    assert receipt["run"]["policy_applied_to"].endswith(": labels and upgradePolicy"), receipt["run"]
    assert verdict(receipt, "device").startswith(f"device: 1/1 pool nodes: driver {FLEET_DRIVER} Ready, then")


def test_v25_takes_the_full_path_for_the_same_change_and_its_pod_deletion_evicts_the_gpu_job(same_version_runs) -> None:
    result, receipt = same_version_runs[OLDER_RELEASE]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"release {OLDER_RELEASE}" in result.stdout
    assert "; full upgrade (pod deletion, no drain)" in verdict(receipt, "rollout"), receipt["verdicts"]
    [eviction] = receipt["evictions"]
    assert eviction["gpus"] == 1 and eviction["allowed"] and "/gpu-train-" in f"/{eviction['name']}", eviction
