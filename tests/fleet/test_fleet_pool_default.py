"""Which pool a run on the local fleet gets by default, and the kubelet pool node's DCGM series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpucanary.config import Settings
from pytest_gpucanary.fleet.kubelet_pool import KubeletPoolProvider
from pytest_gpucanary.fleet.kwok_pool import KwokPoolProvider
from pytest_gpucanary.fleet.dra_slices import SlicePublisher
from pytest_gpucanary.fleet.node_agent import NodeAgent
from pytest_gpucanary.fleet.node_agent_process import dcgm_text
from pytest_gpucanary.target import pool_provider as default_pool_provider
from pytest_gpucanary.canary.pool.existing_node import ExistingNodeProvider


@pytest.fixture
def fleet_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUCANARY_FLEET_DIR", str(tmp_path))
    for name in ("GPUCANARY_FLEET_KUBELET_POOL", "GPUCANARY_FLEET_KUBELET_NODES", "GPUCANARY_FLEET_DRIVER_MODE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_the_fleet_default_pool_is_its_kubelet_node_and_kwok_stays_a_setting(fleet_dir: Path) -> None:
    provider = default_pool_provider(Settings())
    assert isinstance(provider, KubeletPoolProvider) and provider.name == "kubelet"
    assert provider.selector == "gpucanary.io/node-kind=kubelet,gpucanary.io/driver-pool"
    assert isinstance(default_pool_provider(Settings(pool_provider="kwok")), KwokPoolProvider)


def test_a_running_fleet_without_a_kubelet_pool_gets_kwok_pools(fleet_dir: Path) -> None:
    (fleet_dir / "fleet.json").write_text(json.dumps({"kubelet_pool": False}))
    assert isinstance(default_pool_provider(Settings()), KwokPoolProvider)
    assert isinstance(default_pool_provider(Settings(pool_provider="kubelet")), KubeletPoolProvider)


def test_a_real_cluster_never_gets_a_fleet_pool(fleet_dir: Path) -> None:
    provider = default_pool_provider(Settings(kubeconfig=fleet_dir / "kubeconfig", pool_node="gpu-1"))
    assert type(provider) is ExistingNodeProvider


def test_dcgm_series_of_a_kubelet_node_follow_its_gfd_label_and_annotations() -> None:
    node = {"metadata": {"name": "gpu-kubelet-0", "annotations": {"gpucanary.io/simulated-xid": "79"}, "labels": {
        "nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/cuda.driver-version.full": "580.95.05"}}}
    lines = [line for line in dcgm_text([node]).splitlines() if not line.startswith("#")]
    assert lines == [
        f'{name}{{gpu="{gpu}",UUID="GPU-gpu-kubelet-0-{gpu}",Hostname="gpu-kubelet-0",modelName="NVIDIA-H100-80GB-HBM3",'
        f'DCGM_FI_DRIVER_VERSION="580.95.05"}} {value}'
        for name, value in (("DCGM_FI_DEV_GPU_UTIL", 0), ("DCGM_FI_DEV_XID_ERRORS", 79)) for gpu in (0, 1)]


def test_a_gpucluster_kubelet_nodes_dcgm_series_follow_its_ready_driver_pod() -> None:
    """In GPUCluster mode no GFD labels the node: its series carry the GPUs of the fleet and the version of its Ready
    driver pod, and there are none while no driver pod is Ready (DCGM has no driver to read)."""
    node = {"metadata": {"name": "gpu-kubelet-0", "labels": {"gpucanary.io/node-kind": "kubelet"}}}
    agent = NodeAgent(kube=None, slices=SlicePublisher(kube=None))  # type: ignore[arg-type]  # no API here
    agent.kubelet_pool["gpu-kubelet-0"] = node

    def driver(ready: bool, version: str, uid: str) -> dict:
        return {"metadata": {"uid": uid, "labels": {"app.kubernetes.io/component": "nvidia-driver"}},
                "spec": {"nodeName": "gpu-kubelet-0",
                         "containers": [{"image": f"nvcr.io/nvidia/driver:{version}-ubuntu22.04"}]},
                "status": {"phase": "Running", "containerStatuses": [{"ready": ready}]}}

    assert [line for line in dcgm_text(agent.kubelet_pool_nodes()).splitlines() if not line.startswith("#")] == []
    agent.pods = {"a": driver(False, "580.82.07", "a")}
    assert [line for line in dcgm_text(agent.kubelet_pool_nodes()).splitlines() if not line.startswith("#")] == []
    agent.pods = {"b": driver(True, "580.95.05", "b")}
    lines = [line for line in dcgm_text(agent.kubelet_pool_nodes()).splitlines() if not line.startswith("#")]
    assert len(lines) == 16 and all('DCGM_FI_DRIVER_VERSION="580.95.05"' in line for line in lines), lines
    assert 'modelName="NVIDIA H100 80GB HBM3"' in lines[0] and 'gpu="7"' in lines[7], lines
    assert "nvidia.com/gpu.count" not in node["metadata"]["labels"]          # the watched node is left as it was
    agent.slices = None                                          # ClusterPolicy mode: GFD's labels or no series
    assert [line for line in dcgm_text(agent.kubelet_pool_nodes()).splitlines() if not line.startswith("#")] == []
