"""The network rung on a fleet configured for GPUDirect RDMA (`GPUCANARY_FLEET_GPU_RDMA=1`: driver.rdma with
host MOFED, so the real operator puts `nvidia-peermem-ctr` into every driver pod, and the node agent
shows the RDMA shared device plugin's devices), with two real kubelet nodes beside its KWOK GPU node.

- Three one-node pool runs at once, each with the collective probe between its pool node and the
  fleet's GPU node (the peer, on the old driver): a clean one passes the rung with its evidence and
  both probe figures; one whose pool node loses nvidia_peermem once back in service, and one whose
  all-reduce never completes after the swap, fail at network with the cause in the first line.
- The collective probe as real processes: the fleet's TCP all-reduce between two pods on the two
  kubelet nodes, its figure read from rank 0's termination message.
The session fleet has no GPU networking, so its runs report the rung skipped, saying so.
"""

from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from harness import FAST, KEEP_FLEET, TARGET, gpucanary, port_beside_session, second_fleet_env
from test_device_rung import _inject_once_upgrading

from pytest_gpucanary.canary.collective import CollectiveProbe
from pytest_gpucanary.canary.workloads import Placement
from pytest_gpucanary.config import Settings
from pytest_gpucanary.fleet.layout import KUBELET_WORKLOAD_OFFSETS
from pytest_gpucanary.fleet.collective_stand_in import COLLECTIVE_ANNOTATION
from pytest_gpucanary.fleet.node_agent import PEERMEM_ANNOTATION
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.ownership import owned_labels
from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PORT_BASE = port_beside_session("rdma")     # a second fleet beside the session's
PEER = "gpu-node-0"            # the fleet's one KWOK GPU node: on the old driver through every run
PROBE_TIMEOUT_S = 30
FAULTS = {"clean": None,
          "peermem-lost": {"metadata": {"annotations": {PEERMEM_ANNOTATION: "lost"}}},
          "probe-hangs": {"metadata": {"annotations": {COLLECTIVE_ANNOTATION: "never-completes"}}}}


@pytest.fixture(scope="module")
def rdma_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = second_fleet_env("rdma", tmp_path_factory.mktemp("rdma-fleet"), gpucanary_fleet,
                           GPUCANARY_FLEET_GPU_NODES="1", GPUCANARY_FLEET_KUBELET_NODES="2",
                           GPUCANARY_FLEET_GPU_RDMA="1",
                           GPUCANARY_OPERATOR_BIN_DIR=str(gpucanary_fleet.fleet.binaries().operator))
    up = gpucanary("fleet", "up", env={**KEEP_FLEET, **env})
    assert up.returncode == 0, up.stderr[-3000:]
    yield env
    gpucanary("fleet", "down", env={**KEEP_FLEET, **env})


@pytest.fixture(scope="module")
def rdma_kube(rdma_fleet: dict[str, str]) -> Kube:
    return Kube.connect(Path(rdma_fleet["GPUCANARY_FLEET_DIR"]) / "kubeconfig")


def _run(env: dict[str, str], kube: Kube, fault: str, reports: Path) -> tuple[int, str, dict, Path]:
    run_id = f"net-{fault[:4]}-{uuid.uuid4().hex[:4]}"
    stop = threading.Event()
    if FAULTS[fault] is not None:
        threading.Thread(target=_inject_once_upgrading, args=(kube, f"canary-{run_id}-0", FAULTS[fault], stop),
                         daemon=True).start()
    try:
        result = gpucanary("run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                           f"--gpucanary-driver-version={TARGET}", *FAST, "--gpucanary-load-users=4",
                           f"--gpucanary-collective-timeout-s={PROBE_TIMEOUT_S}", f"--gpucanary-run-id={run_id}",
                           f"--gpucanary-reports-dir={reports}", env={**KEEP_FLEET, **env})
    finally:
        stop.set()
    receipt = reports / run_id / "receipt.json"
    return (result.returncode, result.stdout[-3000:] + result.stderr[-2000:],
            json.loads(receipt.read_text()) if receipt.exists() else {}, reports / run_id)


@pytest.fixture(scope="module")
def runs(rdma_fleet: dict[str, str], rdma_kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    reports = tmp_path_factory.mktemp("network-runs")
    with ThreadPoolExecutor(len(FAULTS)) as pool:
        futures = {fault: pool.submit(_run, rdma_fleet, rdma_kube, fault, reports) for fault in FAULTS}
        return {fault: future.result() for fault, future in futures.items()}


def _network(receipt: dict) -> dict:
    return next(v for v in receipt["verdicts"] if v["stage"] == "network")


def test_a_one_node_pool_on_an_rdma_cluster_passes_the_network_rung_with_both_probe_figures(runs) -> None:
    code, output, receipt, run_dir = runs["clean"]
    assert code == 0, output
    pool = receipt["run"]["pool_nodes"][0]
    network = _network(receipt)
    assert network["outcome"] == "pass", network
    assert network["summary"] == (f"network: 1/1 pool nodes: GPUDirect RDMA (nvidia-peermem) back, "
                                  f"rdma/rdma_shared_device_a back after the driver swap; collective probe 24.00 GB/s "
                                  f"after vs 24.00 GB/s baseline ({pool} <-> {PEER}, simulated)")
    texts = [e["text"] for e in network["evidence"]]
    assert "nvidia-peermem-ctr: ready" in texts and any(t.startswith("rdma/rdma_shared_device_a = 63") for t in texts)
    baseline, after = receipt["collective"]["runs"]
    assert (baseline["when"], after["when"]) == ("baseline", "after")
    assert baseline["nodes"] == after["nodes"] == [pool, PEER]
    assert baseline["drivers"][0] == after["drivers"][1] == baseline["drivers"][1] != TARGET
    assert after["drivers"][0] == TARGET          # across the boundary: new driver <-> old driver
    assert baseline["busbw_gbps"] == after["busbw_gbps"] == 24.0 and baseline["how"] == "simulated"
    assert baseline["started_offset_s"] < 0 < after["started_offset_s"]
    assert 0 < baseline["took_s"] < 60 and 0 < after["took_s"] < 60
    assert "## Collective probe" in (run_dir / "receipt.md").read_text()
    assert "baseline: 24.0 GB/s" in (run_dir / "receipt.html").read_text()


def test_peermem_that_does_not_come_back_fails_the_network_rung_naming_it(runs) -> None:
    code, output, receipt, _ = runs["peermem-lost"]
    assert code != 0, output
    pool = receipt["run"]["pool_nodes"][0]
    assert receipt["first_failed"] == "network", receipt["verdicts"]
    summary = _network(receipt)["summary"]
    assert summary.startswith("network: GPUDirect RDMA (nvidia-peermem): container nvidia-peermem-ctr of driver pod ")
    assert summary.endswith(f" on {pool} is not ready after the driver swap (+1 more fail)"), summary
    after = receipt["collective"]["runs"][1]
    assert after["busbw_gbps"] is None and after["detail"] == f"did not complete within {PROBE_TIMEOUT_S} s of starting"


def test_a_collective_probe_that_does_not_complete_after_the_swap_fails_the_network_rung(runs) -> None:
    code, output, receipt, run_dir = runs["probe-hangs"]
    assert code != 0, output
    pool = receipt["run"]["pool_nodes"][0]
    assert receipt["first_failed"] == "network", receipt["verdicts"]
    assert _network(receipt)["summary"] == (
        f"network: collective probe {pool} <-> {PEER} after the driver swap: did not complete within "
        f"{PROBE_TIMEOUT_S} s of starting (baseline 24.00 GB/s)")
    assert "after: no result" in (run_dir / "receipt.html").read_text()


def test_the_collective_probe_runs_as_real_processes_on_two_kubelet_nodes(rdma_kube: Kube, tmp_path: Path) -> None:
    manifest = yaml.safe_load((FIXTURES / "fleet" / "collective-probe-tcp.yaml").read_text())
    port = str(PORT_BASE + KUBELET_WORKLOAD_OFFSETS[-1])
    for env in manifest["spec"]["containers"][0]["env"]:
        if env["name"] == "GPUCANARY_MASTER_PORT":
            env["value"] = port
    path = tmp_path / "collective-probe.yaml"
    path.write_text(yaml.safe_dump(manifest))
    namespace = f"gpucanary-allreduce-{uuid.uuid4().hex[:4]}"
    rdma_kube.create({"apiVersion": "v1", "kind": "Namespace",
                      "metadata": {"name": namespace, "labels": owned_labels("allreduce-e2e")}})
    try:
        settings = Settings(collective_probe=path, collective_timeout_s=90)
        probe = CollectiveProbe(rdma_kube, Placement(namespace, "allreduce-e2e", "gpu-kubelet-0"),
                                ("gpu-kubelet-0", "gpu-kubelet-1"), settings).start("baseline", start_timeout_s=90)
        result = probe.finish(print)
        assert result.detail == "" and result.how == "ran", result
        assert result.busbw_gbps is not None and result.busbw_gbps > 0
        pods = {p["metadata"]["name"]: p for p in rdma_kube.list("v1", "Pod", namespace=namespace)}
        assert {p["spec"]["nodeName"] for p in pods.values()} == {"gpu-kubelet-0", "gpu-kubelet-1"}
        assert all(p["status"]["phase"] == "Succeeded" for p in pods.values())
        log = rdma_kube.pod_log("collective-baseline-1", namespace=namespace)
        assert "# Out of bounds values : 0 OK" in log and "# Avg bus bandwidth" in log
    finally:
        rdma_kube.delete("v1", "Namespace", namespace)
