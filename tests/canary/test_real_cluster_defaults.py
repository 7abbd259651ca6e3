"""The shipped workloads as a real cluster gets them: public images with overrides and a mirror, a GPU
job whose every pod works until one deadline, image pulls judged from the kubelet's words, the Job's
completion (not a pod's state) in the application stage, and the ClusterPolicy-mode exposure."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pytest_gpucanary.canary import workloads
from pytest_gpucanary.canary.preflight import exposure
from pytest_gpucanary.canary.recorder import Record
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.config import GPU_JOB_IMAGE, PROBE_IMAGE, SERVICE_IMAGE, Settings, mirrored
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.ladder import Outcome, RunEvidence, Stage, evaluate
from pytest_gpucanary.shipped import FIXTURES

from canned_runs import at, clean_run  # noqa: E402  canned timelines shared with the ladder's tests

PLACEMENT = workloads.Placement("gpucanary-r1", "r1", "canary-r1-0")


def test_the_shipped_manifests_run_the_declared_default_images() -> None:
    assert workloads.images_of(workloads.rendered(Settings(), PLACEMENT)) == [GPU_JOB_IMAGE, SERVICE_IMAGE, PROBE_IMAGE]


def test_an_image_knob_wins_over_the_mirror_and_the_mirror_keeps_each_path() -> None:
    settings = Settings(image_registry="mirror.example.com:5000/gpu", probe_image="registry.local/tools/busybox:1")
    assert workloads.images_of(workloads.rendered(settings, PLACEMENT)) == [
        "mirror.example.com:5000/gpu/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0-ubuntu22.04",
        "mirror.example.com:5000/gpu/e2e-test-images/agnhost:2.63.0", "registry.local/tools/busybox:1"]
    assert mirrored("busybox:1.36", "m.local") == "m.local/library/busybox:1.36"


def test_the_shipped_holder_holds_the_driver_on_the_pool_and_a_workload_that_does_not_is_refused(tmp_path) -> None:
    from pytest_gpucanary.gpu_operator import holds_driver

    settings = Settings(holder=FIXTURES / "workloads" / "holder.yaml", probe_image="registry.local/tools/busybox:1")
    [holder] = workloads.holder(settings.holder, PLACEMENT, images=settings.images())
    spec = holder["spec"]["template"]["spec"]
    assert holds_driver(spec) == "NVIDIA_VISIBLE_DEVICES=all"
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "canary-r1-0"}
    assert spec["containers"][0]["image"] == "registry.local/tools/busybox:1"      # the probe image's knob
    assert holder["metadata"]["labels"]["gpucanary.io/role"] == "holder"
    assert "registry.local/tools/busybox:1" in workloads.images_of(workloads.rendered(settings, PLACEMENT))
    plain = tmp_path / "plain.yaml"
    plain.write_text((FIXTURES / "workloads" / "holder.yaml").read_text().replace("NVIDIA_VISIBLE_DEVICES", "OTHER"))
    with pytest.raises(ConfigError, match="holder manifest .*plain.yaml has a workload whose pods do not hold"):
        workloads.check(Settings(holder=plain))


def test_a_bad_image_or_registry_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match="--gpucanary-gpu-job-image='Bad Image' must be an image reference"):
        Settings(gpu_job_image="Bad Image")
    with pytest.raises(ConfigError, match="--gpucanary-image-registry='https://m' must be a registry host"):
        Settings(image_registry="https://m")


def test_every_pod_of_the_gpu_job_works_until_one_deadline() -> None:
    job = workloads.gpu_job(None, PLACEMENT, duration_s=210, now_wall_s=1_800_000_000.4)
    template = job["spec"]["template"]
    [container] = template["spec"]["containers"]
    assert {"name": "GPUCANARY_WORK_UNTIL_EPOCH_S", "value": "1800000210"} in container["env"]
    until = datetime.fromisoformat(template["metadata"]["annotations"][workloads.RUN_DURATION_ANNOTATION])
    assert until.timestamp() == 1_800_000_210       # KWOK ends the pod at the same moment the script does
    assert workloads.work_until_wall_s(job) == 1_800_000_210
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in template["spec"]["volumes"]
    assert "/cuda-samples/vectorAdd" in container["args"][0] and container["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize(("status", "expected"), [
    ({"containerStatuses": [{"state": {"running": {}}}]}, True),
    ({"containerStatuses": [{"state": {"terminated": {"exitCode": 127}}}]}, True),    # no shell: pulled anyway
    ({"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}}]}, False),
    ({"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}, None),
    ({"phase": "Pending"}, None),
])
def test_an_image_pull_is_judged_from_the_container_state(status: dict, expected: bool | None) -> None:
    assert workloads.pull_state({"status": status})[0] is expected


def test_the_image_pull_pod_is_owned_by_the_run_and_asks_for_no_gpu() -> None:
    pod = workloads.image_pull_pod(GPU_JOB_IMAGE, PLACEMENT, index=0)
    assert pod["metadata"]["labels"]["gpucanary.io/run-id"] == "r1" and pod["metadata"]["namespace"] == "gpucanary-r1"
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "canary-r1-0"}
    assert "limits" not in pod["spec"]["containers"][0]["resources"]


def job_record(offset_s: float, *, complete: bool = False, failed: str = "", succeeded: int = 0) -> Record:
    conditions = ([{"type": "Complete", "status": "True"}] if complete else []) + (
        [{"type": "Failed", "status": "True", "reason": failed}] if failed else [])
    obj = {"metadata": {"namespace": "default", "name": "train"},
           "status": {"succeeded": succeeded, "active": 0 if complete or failed else 1, "conditions": conditions}}
    return Record("canary-jobs", "MODIFIED", "Job", "default", "train", at(offset_s), at(offset_s), obj)


def test_the_job_completing_passes_the_stage_with_when() -> None:
    evidence = clean_run()
    evidence = dataclasses.replace(evidence, records=evidence.records + (job_record(-40), job_record(401, complete=True,
                                                                                                     succeeded=1)))
    verdict = evaluate(evidence).verdict(Stage.APPLICATION)
    assert verdict.outcome is Outcome.PASS
    assert "GPU job default/train completed at +401s (2 pod(s), 1 evicted)" in verdict.summary


def test_a_job_not_complete_fails_saying_how_far_it_got_even_with_a_succeeded_pod() -> None:
    evidence = clean_run(gpu_job_work_s=210.0, gpu_job_until_wall_ns=at(170))
    evidence = dataclasses.replace(evidence, records=evidence.records + (job_record(-40),))
    verdict = evaluate(evidence).verdict(Stage.APPLICATION)
    assert verdict.outcome is Outcome.FAIL
    # train-a1 ran from -40 s to its eviction at +20 s, train-b2 from +150 s to +400 s
    assert verdict.summary.startswith("application: GPU job default/train did not finish (")
    assert "expected the Job Complete; its pods ran 310 s of 210 s, deadline +170s, 1 evicted)" in verdict.summary


def test_a_failed_job_names_the_job_controllers_reason() -> None:
    evidence = clean_run()
    evidence = dataclasses.replace(evidence, records=evidence.records + (job_record(300, failed="BackoffLimitExceeded"),))
    assert "Job Failed (BackoffLimitExceeded)" in evaluate(evidence).verdict(Stage.APPLICATION).summary


def test_the_exposure_survives_the_evidence_round_trip(tmp_path: Path) -> None:
    evidence = clean_run(exposure=("ClusterPolicy mode: ...",), held_nodes=("gpu-1",), gpu_job_work_s=210.0)
    evidence.write(tmp_path)
    (tmp_path / "timeline.jsonl").write_text("".join(r.to_json() + "\n" for r in evidence.records))
    again = RunEvidence.read(tmp_path)
    assert (again.exposure, again.held_nodes, again.gpu_job_work_s) == (("ClusterPolicy mode: ...",), ("gpu-1",), 210.0)


def test_clusterpolicy_mode_says_what_changes_cluster_wide_and_which_nodes_are_held() -> None:
    cluster = ClusterInfo("cluster-policy", False, False, "gpu-operator", ("gpu-0", "gpu-1", "pool-0"))
    lines = exposure(cluster, pool_nodes=("pool-0",), target="580.95.05")
    assert lines[0].startswith("ClusterPolicy mode: for the run's duration the cluster-wide driver version in "
                               "ClusterPolicy cluster-policy is 580.95.05")
    assert lines[1].endswith("nvidia.com/gpu-driver-upgrade.skip=true for the run's duration: 2 GPU node(s): gpu-0, gpu-1")
    assert "recommended: NVIDIADriver mode" in lines[2]
    assert exposure(dataclasses.replace(cluster, nvidiadriver_mode=True, per_driver_policy=True)) == ()


def test_gpucanary_run_ignores_the_callers_pytest_configuration(tmp_path: Path) -> None:
    """A caller's pytest.ini with bad addopts and a conftest that raises change nothing; no cache is left."""
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --no-such-option\n")
    (tmp_path / "conftest.py").write_text("raise RuntimeError('the caller conftest was imported')\n")
    result = subprocess.run([sys.executable, "-m", "pytest_gpucanary.cli", "run", "--collect-only", "-q",
                             f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                             "--gpucanary-driver-version=580.95.05", f"--gpucanary-reports-dir={tmp_path / 'r'}"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "5 tests collected" in result.stdout
    assert not (tmp_path / ".pytest_cache").exists()


def test_preflight_refuses_bad_input_before_connecting(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pytest_gpucanary.cli", "preflight",
                             "--gpucanary-driver-version=580.95.05", "--gpucanary-kubeconfig=/nonexistent"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 4
    assert result.stderr.strip() == "gpucanary: error: no upgrade policy given; pass --gpucanary-policy PATH"
