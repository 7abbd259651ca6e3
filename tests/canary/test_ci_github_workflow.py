"""The GitHub Actions template's run: steps, executed in order as a runner would, against the fleet.

What a runner provides is provided here: the job's env with its ${{ }} expressions resolved, the
step's own env, RUNNER_TEMP, GITHUB_STEP_SUMMARY, GITHUB_RUN_ID/ATTEMPT, `bash --noprofile --norc
-eo pipefail` per step, and `if:` decided from the earlier steps' outcomes. The `uses:` steps
(checkout, upload-artifact) are not run: the workspace is laid out as checkout would leave it.

The one substitution: GPUCANARY_FROM is a wheel directory holding this worktree's wheel (built by
ci/wheelhouse.sh) instead of the release tag, so the install step installs the code under test.
The cluster is the fleet, given as the kubeconfig secret; its standing canary pool is a GPU node
labelled pool=gpu-canary (the template's default selector), made as a cluster's owners would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

import pytest
import xmlschema
import yaml
from harness import TARGET

from pytest_gpucanary.kube import Kube
from pytest_gpucanary.shipped import FIXTURES, REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEMPLATE = REPO_ROOT / "ci" / "templates" / "github-actions.yaml"
SCHEMA = xmlschema.XMLSchema10(REPO_ROOT / "tests" / "schemas" / "junit-10.xsd")
RUN_ID, ATTEMPT = "4242", "1"
# What a runner gives each `shell: bash` step (GitHub's documented command line for it).
BASH = ["bash", "--noprofile", "--norc", "-eo", "pipefail"]


def resolve(value: str, expressions: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        expression = match.group(1).strip()
        assert expression in expressions, f"the test gives no value for ${{{{ {expression} }}}}"
        return expressions[expression]
    return re.sub(r"\$\{\{(.*?)\}\}", one, str(value))


def should_run(condition: str | None, outcomes: dict[str, str]) -> bool:
    if condition is None:       # success(): every earlier step succeeded
        return all(outcome == "success" for outcome in outcomes.values())
    if condition == "always()":
        return True
    match = re.fullmatch(r"always\(\) && steps\.(\w+)\.outcome == '(\w+)'", condition)
    assert match, f"the test cannot evaluate if: {condition}"
    return outcomes.get(match.group(1)) == match.group(2)


def run_steps(job: dict, *, env: dict[str, str], expressions: dict[str, str], workspace: Path,
              logs: Path) -> dict[str, tuple[str, str]]:
    """Each run: step in order; returns step id or name -> (outcome, output)."""
    assert job["defaults"]["run"]["shell"] == "bash"
    job_env = {key: resolve(value, expressions) for key, value in job["env"].items()}
    outcomes: dict[str, str] = {}
    results: dict[str, tuple[str, str]] = {}
    for index, step in enumerate(job["steps"]):
        key = step.get("id") or step.get("name") or step["uses"]
        if "uses" in step:
            continue
        if not should_run(step.get("if"), outcomes):
            outcomes[key] = "skipped"
            results[key] = ("skipped", "")
            continue
        script = logs / f"step-{index}.sh"
        script.write_text(step["run"])
        step_env = {key_: resolve(value, expressions) for key_, value in step.get("env", {}).items()}
        proc = subprocess.run([*BASH, str(script)], cwd=workspace, env={**env, **job_env, **step_env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
        outcomes[key] = "success" if proc.returncode == 0 else "failure"
        results[key] = (outcomes[key], proc.stdout)
        (logs / f"step-{index}.log").write_text(proc.stdout)
    return results


@pytest.fixture
def standing_canary_pool(kube: Kube) -> Iterator[str]:
    """A GPU node with an NVIDIADriver of its own, labelled as the cluster's canary pool."""
    from pytest_gpucanary.fleet.kwok_pool import KwokPool, fleet_driver_version

    standing = KwokPool(kube, name=f"ci-canary-{uuid.uuid4().hex[:6]}", run_id="standing")
    [node] = standing.create(driver_version=fleet_driver_version(kube))
    not_ours = {"metadata": {"labels": {"app.kubernetes.io/managed-by": None, "gpucanary.io/run-id": None}}}
    try:
        kube.patch("v1", "Node", node, {"metadata": {"labels": {**not_ours["metadata"]["labels"],
                                                                "pool": "gpu-canary"}}})
        kube.patch("nvidia.com/v1alpha1", "NVIDIADriver", standing.name, not_ours)
        kube.wait_for("v1", "Node", node, lambda n: n["metadata"]["labels"].get(
            "nvidia.com/gpu-driver-upgrade-state") == "upgrade-done", timeout_s=180)
        standing.wait_for_gpus()      # upgrade-done comes with the pod in sync; GFD's driver labels come after
        yield node
    finally:
        standing.delete()


def test_github_workflow_steps_gate_the_canary_pool_and_publish_the_receipt(
        gpucanary_fleet, kube: Kube, standing_canary_pool: str, tmp_path: Path) -> None:
    fleet = gpucanary_fleet.fleet
    node_before = kube.get("v1", "Node", standing_canary_pool)
    wheels = tmp_path / "wheels"
    built = subprocess.run(["bash", str(REPO_ROOT / "ci" / "wheelhouse.sh"), str(wheels), "--no-deps"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert built.returncode == 0, built.stderr[-2000:]

    workspace, runner_temp, logs = tmp_path / "workspace", tmp_path / "runner-temp", tmp_path / "logs"
    for directory in (workspace / "gpu-operator", runner_temp, logs):
        directory.mkdir(parents=True)
    shutil.copy(FIXTURES / "policies" / "default.yaml", workspace / "gpu-operator" / "upgrade-policy.yaml")
    summary = runner_temp / "step-summary.md"
    summary.touch()
    expressions = {
        "vars.GPUCANARY_FROM": str(wheels),                           # the substitution (see the docstring)
        "inputs.driver_version || vars.CANARY_DRIVER_VERSION": TARGET,
        "vars.CANARY_POOL_SELECTOR || 'pool=gpu-canary'": "pool=gpu-canary",
        "github.run_id": RUN_ID, "github.run_attempt": ATTEMPT,
        "secrets.CANARY_KUBECONFIG": Path(fleet.kubeconfig).read_text(),
    }
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "LANG": "C.UTF-8", "CI": "true",
           "GITHUB_ACTIONS": "true", "GITHUB_RUN_ID": RUN_ID, "GITHUB_RUN_ATTEMPT": ATTEMPT, "GITHUB_JOB": "canary",
           "GITHUB_REPOSITORY": "gpu/fleet-policies", "GITHUB_WORKSPACE": str(workspace),
           "RUNNER_TEMP": str(runner_temp), "GITHUB_STEP_SUMMARY": str(summary),
           # the user's own knobs for this 2-core machine and the cluster's Prometheus (GPUCANARY_* env)
           "GPUCANARY_PROMETHEUS_URL": fleet.prometheus_url, "GPUCANARY_PROBE_INTERVAL_S": "10",
           "GPUCANARY_JOB_DURATION_S": "60", "GPUCANARY_BASELINE_S": "10", "GPUCANARY_UPGRADE_BUDGET_S": "420",
           "GPUCANARY_MAX_P99_S": "3"}
    job = yaml.safe_load(TEMPLATE.read_text())["jobs"]["canary"]

    results = run_steps(job, env=env, expressions=expressions, workspace=workspace, logs=logs)

    run_id = f"gh-{RUN_ID}-{ATTEMPT}"
    outcomes = {key: outcome for key, (outcome, _) in results.items()}
    assert list(outcomes.values()) == ["success"] * 6, {k: (o, out[-3000:]) for k, (o, out) in results.items()}
    installed = subprocess.run([str(runner_temp / "gpucanary" / "venv" / "bin" / "python"), "-c",
                                "import importlib.metadata as m, pytest_gpucanary as p; "
                                "print(m.version('pytest-gpucanary'), p.__file__)"],
                               capture_output=True, text=True, timeout=60, cwd=workspace)
    version, location = installed.stdout.split()
    assert version == job["env"]["GPUCANARY_VERSION"] and str(runner_temp) in location   # the venv, not the repo
    assert stat.S_IMODE((runner_temp / "gpucanary" / "kubeconfig").stat().st_mode) == 0o600

    reports = workspace / "reports"
    receipt = json.loads((reports / run_id / "receipt.json").read_text())
    assert receipt["gate_passed"] is True, receipt["verdicts"]
    assert receipt["run"]["run_id"] == run_id and receipt["run"]["pool_nodes"] == [standing_canary_pool]
    assert receipt["run"]["ci"]["provider"] == "github" and receipt["run"]["ci"]["run_id"] == RUN_ID
    markdown = (reports / run_id / "receipt.md").read_text()
    assert summary.read_text() == markdown and markdown.startswith("# gpucanary launch receipt: Gate PASSED")

    for junit in (reports / "junit.xml", reports / run_id / "stages.junit.xml"):
        errors = [f"{e.path}: {e.reason}" for e in SCHEMA.iter_errors(junit.read_text())]
        assert errors == [], f"{junit.name}: {errors}"
    suite = ET.parse(reports / "junit.xml").getroot().find("testsuite")
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert suite.get("tests") == "5" and properties["gpucanary_run_id"] == run_id

    cleanup_output = results["Clean up what this run left in the cluster"][1]
    assert re.search(r"cleanup: \d+ objects deleted or restored", cleanup_output), cleanup_output
    selector = f"gpucanary.io/run-id={run_id}"
    assert [n["metadata"]["name"] for n in kube.list("v1", "Namespace", label_selector=selector)
            if not n["metadata"].get("deletionTimestamp")] == []
    node_after = kube.get("v1", "Node", standing_canary_pool)
    assert node_after["metadata"]["labels"] == node_before["metadata"]["labels"]
    assert "gpucanary.io/saved-node-state" not in node_after["metadata"].get("annotations", {})
    assert not node_after["spec"].get("unschedulable")
