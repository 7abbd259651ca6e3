"""The network rung on a fleet configured for GPUDirect RDMA (`GPUCANARY_FLEET_GPU_RDMA=1`: driver.rdma with
host MOFED, so the real operator puts `nvidia-peermem-ctr` into every driver pod, and the node agent
shows the RDMA shared device plugin's devices): a one-node pool run passes the rung with its evidence.
The session fleet has no GPU networking, so its runs report the rung skipped, saying so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest
from test_canary_gate import FAST, TARGET
from test_restart_only import gpucanary

from pytest_gpucanary.config import FIXTURES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PORT_BASE = int(os.environ.get("GPUCANARY_FLEET_PORT_BASE") or 26400) + 2250  # below 32768 for both workers


@pytest.fixture(scope="module")
def rdma_fleet(gpucanary_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    binaries = gpucanary_fleet.fleet.binaries()
    env = {"GPUCANARY_FLEET_DIR": str(tmp_path_factory.mktemp("rdma-fleet")), "GPUCANARY_FLEET_PORT_BASE": str(PORT_BASE),
           "GPUCANARY_FLEET_GPU_NODES": "1", "GPUCANARY_FLEET_KUBELET_NODES": "0", "GPUCANARY_FLEET_GPU_RDMA": "1",
           "GPUCANARY_BIN_DIR": str(binaries.control_plane), "GPUCANARY_OPERATOR_BIN_DIR": str(binaries.operator)}
    up = gpucanary(env, "fleet", "up")
    assert up.returncode == 0, up.stderr[-3000:]
    yield env
    gpucanary(env, "fleet", "down")


def test_a_one_node_pool_on_an_rdma_cluster_passes_the_network_rung_with_its_evidence(
        rdma_fleet: dict[str, str], tmp_path: Path) -> None:
    result = gpucanary(rdma_fleet, "run", f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                       f"--gpucanary-driver-version={TARGET}", *FAST, "--gpucanary-load-users=4",
                       f"--gpucanary-reports-dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    [receipt] = [json.loads(p.read_text()) for p in tmp_path.glob("*/receipt.json")]
    network = next(v for v in receipt["verdicts"] if v["stage"] == "network")
    assert network["outcome"] == "pass", network
    assert network["summary"] == ("network: 1/1 pool nodes: GPUDirect RDMA (nvidia-peermem) back, "
                                  "rdma/rdma_shared_device_a back after the driver swap (one-node pool: no "
                                  "collective probe)")
    texts = [e["text"] for e in network["evidence"]]
    assert "nvidia-peermem-ctr: ready" in texts and any(t.startswith("rdma/rdma_shared_device_a = 63") for t in texts)
