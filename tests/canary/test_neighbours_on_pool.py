"""Others acting on the pool while a run upgrades it, on the local fleet: a quarantine taint put on and lifted by
hand (as NVSentinel's would be), and a NodeMaintenance for the pool node (the maintenance operator's CRD installed
for the test). The receipt names each with its writer; the upgrade's own cordon is not among them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from canary_process import run_until_applied
from harness import FAST, TARGET

from pytest_gpucanary.canary.neighbours import NODE_MAINTENANCE
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import RUN_ID_LABEL
from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUARANTINE = "nvsentinel.dgxc.nvidia.com/quarantine"
# the maintenance operator's NodeMaintenance (maintenance.nvidia.com/v1alpha1), only as far as this test needs it
CRD = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
       "metadata": {"name": "nodemaintenances.maintenance.nvidia.com"},
       "spec": {"group": "maintenance.nvidia.com", "scope": "Namespaced",
                "names": {"plural": "nodemaintenances", "singular": "nodemaintenance", "kind": "NodeMaintenance"},
                "versions": [{"name": "v1alpha1", "served": True, "storage": True,
                              "schema": {"openAPIV3Schema": {"type": "object",
                                                             "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_the_receipt_names_the_taint_and_node_maintenance_others_put_on_the_pool(gpucanary_fleet, kube: Kube,
                                                                                  tmp_path: Path) -> None:
    kubectl = gpucanary_fleet.fleet.kubectl
    kubectl("apply", "-f", "-", stdin=json.dumps(CRD))
    kubectl("wait", "--for=condition=Established", "crd/nodemaintenances.maintenance.nvidia.com", "--timeout=60s")
    reports = tmp_path / "reports"
    try:
        proc, seen = run_until_applied([f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                                        f"--gpucanary-driver-version={TARGET}", *FAST, f"--gpucanary-reports-dir={reports}"])
        [pool] = [n["metadata"]["name"] for n in kube.list("v1", "Node", label_selector=RUN_ID_LABEL)]
        kubectl("taint", "node", pool, f"{QUARANTINE}=true:NoSchedule")
        kube.create({"apiVersion": NODE_MAINTENANCE[0], "kind": NODE_MAINTENANCE[1],
                     "metadata": {"name": "net-upgrade", "namespace": "default"},
                     "spec": {"nodeName": pool, "requestorID": "nvidia.network.operator"}})
        time.sleep(3)
        kubectl("taint", "node", pool, f"{QUARANTINE}-")           # lifted again, so the upgrade goes on
        kube.delete(*NODE_MAINTENANCE, "net-upgrade", namespace="default")
        rest, _ = proc.communicate(timeout=900)
        output = "".join(seen) + rest
        assert proc.returncode in (0, 1), output[-3000:]
    finally:
        try:
            kube.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", CRD["metadata"]["name"])
        except NotFound:
            pass
    [run_dir] = [p for p in reports.iterdir() if p.is_dir()]
    receipt = json.loads((run_dir / "receipt.json").read_text())
    acts = [(a["node"], a["what"], a["by"]) for a in receipt["run"]["neighbours"]]
    # the untaint's writer is kubectl's while another taint stays (the cordon's node.kubernetes.io/unschedulable,
    # if the upgrade has cordoned by then); with the last taint gone the apiserver keeps no writer of spec.taints
    untaint = next((by for _, what, by in acts if what.startswith("untainted")), None)
    assert untaint in ("kubectl-taint", "unknown"), acts
    assert sorted(acts) == sorted([(pool, f"tainted {QUARANTINE}=true:NoSchedule", "kubectl-taint"),
                                   (pool, "NodeMaintenance default/net-upgrade began", "nvidia.network.operator"),
                                   (pool, f"untainted {QUARANTINE}=true:NoSchedule", untaint),
                                   (pool, "NodeMaintenance default/net-upgrade ended", "nvidia.network.operator")]), \
        (acts, output[-2000:])      # the operator's own cordon of the pool is not among them
    whats = [what for _, what, _ in acts]
    assert whats.index(f"tainted {QUARANTINE}=true:NoSchedule") < whats.index(f"untainted {QUARANTINE}=true:NoSchedule")
    assert "| others on the pool | " in (run_dir / "receipt.md").read_text()
