"""The gate under least privilege: one rule removed from deploy/'s is one line from the preflight, exit 6,
before anything is written. (The whole gates under exactly deploy/'s rules run from the installed wheel,
in test_installed_package.py.)

The other canary e2e tests keep the fleet's admin kubeconfig: they read the fleet's own ingress and
Prometheus through the plugin's fleet fixture, which a --gpucanary-kubeconfig run does not use.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import TARGET, gpucanary

from pytest_gpucanary.kube import Kube
from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e]

POLICY = f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}"


def test_one_rule_removed_is_one_preflight_line_and_the_run_writes_nothing(
        canary_service_account, kube: Kube, tmp_path: Path) -> None:
    kubeconfig = canary_service_account("gpucanary-nojobs", without=("create", "jobs"))
    args = (f"--gpucanary-kubeconfig={kubeconfig}", "--gpucanary-pool-provider=kwok", POLICY,
            f"--gpucanary-driver-version={TARGET}")
    result = gpucanary("preflight", *args, timeout_s=60)
    assert result.returncode == 6, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("gpucanary: error:")]
    assert errors == ["gpucanary: error: missing permission: create jobs.batch (to the GPU job and the start "
                      "probes); grant the rules of deploy/rbac.yaml"], result.stderr
    assert json.loads(result.stdout)["problems"] == [errors[0].removeprefix("gpucanary: error: ")]
    before = live_namespaces(kube)
    run = gpucanary("run", *args, "--gpucanary-run-id=nojobs", f"--gpucanary-reports-dir={tmp_path}", timeout_s=120)
    assert run.returncode == 6, run.stdout[-2000:] + run.stderr[-2000:]
    assert "missing permission: create jobs.batch" in run.stdout and "Traceback" not in run.stdout
    assert live_namespaces(kube) <= before     # an earlier run's namespace may finish terminating meanwhile


def live_namespaces(kube: Kube) -> set[str]:
    return {n["metadata"]["name"] for n in kube.list("v1", "Namespace") if not n["metadata"].get("deletionTimestamp")}

