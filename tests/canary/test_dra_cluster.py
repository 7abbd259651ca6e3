"""A cluster that offers GPUs through DRA: preflight finds NVIDIA's ResourceSlices on the real apiserver (resource.k8s.io/v1)
and says what a run there does not prove, naming the nodes; without them it says nothing of DRA. On a fleet in
GPUCluster mode (GPUCANARY_FLEET_DRA=1: the real operator deploys NVIDIA's DRA kubelet plugin and DRA validator, no
device plugin, and the KWOK GPU nodes publish their GPUs as ResourceSlices), the canary finds the mode by itself, its
GPU job claims its GPU, and its device rung reads the pool node's slices and DRA operands across the real operator's
driver swap."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import FAST, TARGET, gpucanary, receipt_of, second_fleet

from pytest_gpucanary.fleet.binaries import CI_DIR
from pytest_gpucanary.fleet.dra_slices import _resource_slice
from pytest_gpucanary.fleet.images import NVML_STATE_SCRIPT, nvml_gpus
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e]

PREFLIGHT = ["preflight", "--gpucanary-pool-provider=kwok", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
             f"--gpucanary-driver-version={TARGET}"]


def preflight() -> tuple[dict, str]:
    done = gpucanary(*PREFLIGHT, unbuffered=False, timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout), done.stderr


def test_preflight_names_the_nodes_that_offer_gpus_through_dra(gpucanary_fleet, kube: Kube) -> None:
    report, _ = preflight()
    assert report["unproven"] == []
    node = "gpu-node-0"
    made = kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                        "metadata": {"generateName": f"{node}-gpu.nvidia.com-"},
                        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                                 "devices": [{"name": "gpu-0", "attributes": {
                                     "driverVersion": {"version": "580.82.7"}, "productName": {"string": "NVIDIA H200"}}}]}})
    try:
        report, stderr = preflight()
    finally:
        kube.delete("resource.k8s.io/v1", "ResourceSlice", made["metadata"]["name"])
    [line] = report["unproven"]
    assert line.startswith(f"1 node(s) offer GPUs through DRA (gpu.nvidia.com ResourceSlices: {node}): the canary's GPU "
                           "job claims its GPU through DRA only where the pool's nodes offer GPUs this way"), line
    assert f"gpucanary: not proven: {line}" in stderr


@pytest.fixture(scope="module")
def dra_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from second_fleet("dra", tmp_path_factory.mktemp("dra-fleet"), gpucanary_fleet,
                            GPUCANARY_FLEET_GPU_NODES="1", GPUCANARY_FLEET_KUBELET_NODES="0",
                            GPUCANARY_FLEET_DRA="1")


@pytest.mark.slow
def test_a_dra_run_passes_with_the_pool_nodes_resource_slices_in_its_receipt(dra_fleet: dict[str, str],
                                                                            tmp_path: Path) -> None:
    """The real operator swaps the pool node's driver; the node's slices go away with its operands and come back
    offering the target (580.95.05 as 580.95.5), and its DRA kubelet plugin and DRA validator
    come back Ready after the new driver, which the device rung says with its evidence. The fleet's own GPU node
    offers slices too: preflight names it as not proven by this run."""
    kube = Kube.connect(Path(dra_fleet["KUBECONFIG_PATH"]))
    fleet_slices = kube.list("resource.k8s.io/v1", "ResourceSlice", field_selector="spec.driver=gpu.nvidia.com")
    assert {s["spec"]["nodeName"] for s in fleet_slices} == {"gpu-node-0"}, fleet_slices
    # GPUCluster mode: no ClusterPolicy, no device plugin and no nvidia.com/gpu; the operator's DRA operands instead
    assert kube.list("nvidia.com/v1", "ClusterPolicy") == [] and len(kube.list("nvidia.com/v1alpha1", "GPUCluster")) == 1
    assert "nvidia.com/gpu" not in kube.get("v1", "Node", "gpu-node-0")["status"]["allocatable"]
    operands = {p["metadata"]["labels"].get("app") for p in kube.list("v1", "Pod", namespace="gpu-operator")}
    assert {"nvidia-dra-driver-kubelet-plugin", "nvidia-operator-validator"} <= operands, operands
    assert "nvidia-device-plugin-daemonset" not in operands, operands

    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, env=dra_fleet, reports=tmp_path / "reports")

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "operator in GPUCluster mode, namespace gpu-operator, release v26.7.0" in result.stdout + result.stderr
    receipt = receipt_of(tmp_path / "reports")
    device, offers = assert_slices_back_at_target(receipt)
    assert f"driver {TARGET} Ready, then validator and DRA kubelet plugin Ready" in device["summary"], device["summary"]
    # gone with the plugin pod for the swap, then published again onto the empty pool (generation 1) at the target
    assert "no slice: the DRA kubelet plugin is not registered" in offers, offers
    assert "not proven: 1 node(s) offer GPUs through DRA (gpu.nvidia.com ResourceSlices: gpu-node-0" \
        in result.stdout + result.stderr
    assert_claimed_through_dra(receipt, tmp_path / "reports")


@pytest.fixture(scope="module")
def dra_kubelet_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from second_fleet("dra-kubelet", tmp_path_factory.mktemp("dra-kubelet-fleet"), gpucanary_fleet,
                            GPUCANARY_FLEET_GPU_NODES="1", GPUCANARY_FLEET_KUBELET_NODES="1", GPUCANARY_FLEET_KUBELET_POOL="1",
                            GPUCANARY_FLEET_DRA="1")


@pytest.mark.dra_variants
@pytest.mark.slow
def test_a_dra_run_on_a_kubelet_pool_node_passes_with_nvidias_kubelet_plugin_there(dra_kubelet_fleet: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    """On the real kubelet node the operator's DaemonSet runs NVIDIA's DRA kubelet plugin (over the NVML stand-in,
    under containerd 2): its slice is the plugin's, not the node agent's, the DRA validator's init container runs the
    nvidia-smi that the plugin's CDI spec injects from the driver root, the GPU job's claim is prepared by it, and the
    run passes with the slices going away with the plugin for the swap and coming back at the target."""
    kube = Kube.connect(Path(dra_kubelet_fleet["KUBECONFIG_PATH"]))
    on_node = {p["metadata"]["labels"].get("app"): p for p in kube.list("v1", "Pod", namespace="gpu-operator",
                                                                        field_selector="spec.nodeName=gpu-kubelet-0")}
    assert {"nvidia-dra-driver-kubelet-plugin", "nvidia-operator-validator"} <= set(on_node), sorted(on_node)
    [slice_] = kube.list("resource.k8s.io/v1", "ResourceSlice", field_selector="spec.nodeName=gpu-kubelet-0")
    assert slice_["spec"]["driver"] == "gpu.nvidia.com" and len(slice_["spec"]["devices"]) == 8, slice_["spec"]
    writers = {m["manager"] for m in slice_["metadata"]["managedFields"]}
    assert writers == {"gpu-kubelet-plugin"}, writers          # NVIDIA's plugin wrote it; the node agent never does
    validator = on_node["nvidia-operator-validator"]["metadata"]["name"]
    log = subprocess.run([str(Path(dra_kubelet_fleet["GPUCANARY_BIN_DIR"]) / "kubectl"),
                          f"--kubeconfig={dra_kubelet_fleet['KUBECONFIG_PATH']}", "logs", "-n", "gpu-operator",
                          validator, "-c", "gpu-validation"], capture_output=True, text=True, check=True).stdout
    assert log.strip() == "NVIDIA-SMI 580.82.07   Driver Version: 580.82.07", log

    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, env=dra_kubelet_fleet,
                       reports=tmp_path / "reports")

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "pool gpu-kubelet-0 (kubelet)" in result.stdout + result.stderr
    receipt = receipt_of(tmp_path / "reports")
    assert_slices_back_at_target(receipt)
    assert_claimed_through_dra(receipt, tmp_path / "reports")


def assert_slices_back_at_target(receipt: dict) -> tuple[dict, list[str]]:
    """The device rung passed with the pool node's slices offering the fleet's driver before and the target at the end;
    the rung's verdict and its ResourceSlice evidence, in order."""
    device = next(v for v in receipt["verdicts"] if v["stage"] == "device")
    assert device["outcome"] == "pass" and "gpu.nvidia.com ResourceSlices republished at the target on 1" \
        in device["summary"], device["summary"]
    offers = [e["text"] for e in device["evidence"] if e["kind"] == "ResourceSlice"]
    before, back = (re.fullmatch(r"generation (\d+), 8 devices at driverVersion (\S+)", o) for o in (offers[0], offers[-1]))
    assert before and back and before[2] == "580.82.7" and back[2] == "580.95.5", offers
    return device, offers


def assert_claimed_through_dra(receipt: dict, reports: Path) -> None:
    """The GPU job claimed its GPU through DRA from the run's template, the real scheduler allocated it one of the pool
    node's devices, and the recorder counted it; the run speaks for claim-holding pods, so it does not say otherwise."""
    claims = "the GPU job claims its GPUs through DRA, as the pool offers them (gpu.nvidia.com ResourceSlices): " \
             "ResourceClaimTemplate gpucanary-gpus-1, device class gpu.nvidia.com"
    assert claims in receipt["run"]["pool_setup"], receipt["run"]["pool_setup"]
    assert receipt["run"]["unproven"] == []
    [run_dir] = [p for p in reports.iterdir() if p.is_dir()]
    placed = [r["object"] for r in map(json.loads, (run_dir / "timeline.jsonl").read_text().splitlines())
              if r["kind"] == "Pod" and (r["object"].get("spec") or {}).get("nodeName")]

    def labelled(key: str, value: str) -> list[dict]:
        return [p for p in placed if (p["metadata"].get("labels") or {}).get(key) == value]

    job_pods = labelled("gpucanary.io/role", "gpu-job")
    assert job_pods and all(p["spec"]["claimedGpus"] == 1 and p["spec"]["gpus"] == 1 for p in job_pods), job_pods[-1:]
    fleet_probes = labelled("gpucanary.io/probe-scope", "fleet")     # on the fleet's own DRA node
    assert fleet_probes and all(p["spec"].get("claimedGpus") == 1 for p in fleet_probes), fleet_probes[-1:]


@pytest.mark.dra_variants
def test_a_dra_run_of_the_field_notes_drain_policy_fails_at_application_naming_the_non_gpu_pod(
        dra_fleet: dict[str, str], tmp_path: Path) -> None:
    """On v26.7 pod deletion sees the claim-holding GPU job (an allocated gpu.nvidia.com claim) and refuses its
    emptyDir; the drain fallback then evicts the non-GPU service, which fails the run at application. The GPU job's
    eviction is counted as a GPU pod's, through its claim: it is allowed, the service's is not."""
    result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'field-note.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, env=dra_fleet, reports=tmp_path / "reports")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    receipt = receipt_of(tmp_path / "reports")
    assert receipt["first_failed"] == "application", receipt["first_failed"]
    application = next(v for v in receipt["verdicts"] if v["stage"] == "application")
    assert application["summary"].startswith("application: non-GPU pod gpucanary-"), application["summary"]
    assert "/sched-api-" in application["summary"] and "evicted by drain" in application["summary"]
    gpu_job = [(e["gpus"], e["allowed"]) for e in receipt["evictions"] if e["name"].startswith("gpu-train-")]
    service = [(e["gpus"], e["allowed"]) for e in receipt["evictions"] if e["name"].startswith("sched-api-")]
    assert gpu_job and set(gpu_job) == {(1, True)} and service and set(service) == {(0, False)}, receipt["evictions"]
    assert_claimed_through_dra(receipt, tmp_path / "reports")


def _built(script: str) -> Path:
    done = subprocess.run(["bash", str(CI_DIR / script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return Path(done.stdout.strip())


@pytest.mark.dra_variants
def test_nvidias_dra_kubelet_plugin_publishes_the_slice_the_fleet_stands_in_with(gpucanary_fleet, kube: Kube,
                                                                                 tmp_path: Path) -> None:
    """NVIDIA's GPU kubelet plugin v0.5.0, built unmodified (ci/build-dra-driver.sh) and run over the NVML stand-in as a
    node's loaded driver leaves it (its driver root and state, fleet/images.py), publishes on the real apiserver the
    ResourceSlice that the fleet publishes in its place on KWOK nodes (fleet/dra_slices.py): the same devices (names,
    attributes, memory), pool, slice name and owner."""
    plugin = _built("build-dra-driver.sh") / "gpu-kubelet-plugin"
    shim = _built("build-nvml-shim.sh") / "libnvidia-ml.so.1"
    name = f"dra-plugin-{uuid.uuid4().hex[:6]}"
    node = kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    root = tmp_path / "driver"                      # as the driver container fills /run/nvidia/driver
    (root / "usr" / "lib64").mkdir(parents=True)
    (root / "usr" / "bin").mkdir(parents=True)
    shutil.copy(shim, root / "usr" / "lib64" / "libnvidia-ml.so.1")
    (root / "usr" / "bin" / "nvidia-smi").write_text(f"#!/bin/sh\necho 'Driver Version: {TARGET}'\n")
    (root / "usr" / "bin" / "nvidia-smi").chmod(0o755)
    gpus, state, script = tmp_path / "gpus.env", tmp_path / "gpucanary-nvml.env", tmp_path / "nvml-state"
    gpus.write_text(nvml_gpus(TARGET))
    script.write_bytes(NVML_STATE_SCRIPT)
    subprocess.run(["sh", str(script), str(gpus), str(state)], check=True, env={"PATH": "/usr/bin:/bin", "NODE_NAME": name})
    for sub in ("cdi", "registry", "plugins", "sysfs"):
        (tmp_path / sub).mkdir()
    log = (tmp_path / "plugin.log").open("w")
    process = subprocess.Popen(
        [str(plugin), f"--node-name={name}", f"--kubeconfig={gpucanary_fleet.fleet.kubeconfig}",
         "--image-name=nvcr.io/nvidia/dra-driver-nvidia-gpu:v0.5.0", f"--container-driver-root={root}",
         f"--nvidia-driver-root={root}", "--host-root=/", f"--cdi-root={tmp_path / 'cdi'}",
         "--nvidia-cdi-hook-path=/bin/true", f"--kubelet-registrar-directory-path={tmp_path / 'registry'}",
         f"--kubelet-plugins-directory-path={tmp_path / 'plugins'}", "--healthcheck-port=-1", "-v=4"],
        env={"PATH": "/usr/bin:/bin", "GPUCANARY_NVML_STATE": str(state),
             "NVIDIA_DRA_SYSFS_ROOT": str(tmp_path / "sysfs")},          # no PCI sysfs: no pcieRoot, as on a fleet node
        stdout=log, stderr=subprocess.STDOUT)
    selector = f"spec.nodeName={name},spec.driver=gpu.nvidia.com"
    try:
        deadline = time.monotonic() + 120
        while not (published := kube.list("resource.k8s.io/v1", "ResourceSlice", field_selector=selector)):
            assert process.poll() is None, (tmp_path / "plugin.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "plugin.log").read_text()[-3000:]
            time.sleep(1)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        for made in kube.list("resource.k8s.io/v1", "ResourceSlice", field_selector=selector):
            kube.delete("resource.k8s.io/v1", "ResourceSlice", made["metadata"]["name"])
        try:
            kube.delete("v1", "Node", name)
        except NotFound:
            pass

    [real] = published
    stand_in = _resource_slice(node, TARGET)
    assert sorted(real["spec"]["devices"], key=lambda d: d["name"]) == stand_in["spec"]["devices"]
    assert real["spec"]["pool"] == stand_in["spec"]["pool"] and real["spec"]["nodeName"] == name
    assert real["metadata"]["name"].startswith(stand_in["metadata"]["generateName"]), real["metadata"]["name"]
    assert real["metadata"]["ownerReferences"] == stand_in["metadata"]["ownerReferences"]
