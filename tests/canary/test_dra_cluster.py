"""A cluster that offers GPUs through DRA: preflight finds NVIDIA's ResourceSlices on the real apiserver (resource.k8s.io/v1)
and says what a run there does not prove, naming the nodes; without them it says nothing of DRA."""

from __future__ import annotations

import json

import pytest
from harness import TARGET, gpucanary

from pytest_gpucanary.kube import Kube
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
                           "job and probes request nvidia.com/gpu"), line
    assert f"gpucanary: not proven: {line}" in stderr
