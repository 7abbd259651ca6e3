"""Sweep inputs: the YAML inventory and the loader for fetched Node/Pod dicts."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.sweep.model import VersionSet
from pytest_gpucanary.sweep.inventory import (
    CHECKPOINT_VERSIONS_ANNOTATION, COLD_START_SECONDS_ANNOTATION, REMAINING_SECONDS_ANNOTATION,
    RESTORE_SECONDS_ANNOTATION, apply_overrides, fleet_from_cluster, inventory_from_dict, load_inventory,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "fixtures" / "sweep" / "inventory.yaml"
NOW = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)


def test_the_shipped_example_loads_with_its_change_and_limits() -> None:
    inventory = load_inventory(EXAMPLE)
    assert len(inventory.fleet.nodes) == 9 and len(inventory.fleet.workloads) == 9
    assert inventory.change is not None and inventory.change.target == VersionSet(driver="580.95.05")
    assert (inventory.limits.max_parallel, inventory.limits.max_unavailable) == (2, "25%")
    train = next(w for w in inventory.fleet.workloads if w.name == "train-7b")
    assert train.checkpoint == VersionSet(driver="570.172.08", cuda="12.8") and train.restore_s == 90
    chat = next(w for w in inventory.fleet.workloads if w.name == "chat-70b-0")
    assert (chat.restore_s, chat.cold_start_s, chat.remaining_s) == (63, 1218, None)


def test_command_line_values_take_precedence_over_the_file() -> None:
    inventory = apply_overrides(load_inventory(EXAMPLE), change=["cuda=13.0"], max_parallel="0",
                                max_unavailable="1", hold_back_gpus="16")
    assert inventory.change.target == VersionSet(cuda="13.0") and inventory.change.node_upgrade_s == 900
    assert (inventory.limits.max_parallel, inventory.limits.max_unavailable, inventory.limits.hold_back_gpus) == (
        0, "1", 16)


@pytest.mark.parametrize(("data", "says"), [
    ({"nodes": [{"name": "a", "gpu_model": "H100", "gpus": 8, "color": "red"}]}, "unknown key 'color'"),
    ({"nodes": [{"name": "a", "gpu_model": "H100", "gpus": "eight"}]}, "not a whole number"),
    ({"nodes": [{"name": "a", "gpu_model": "H100", "gpus": 8, "versions": {"cuda": 12.8}}]}, "must be quoted"),
    ({"workloads": [{"name": "w", "node": "ghost", "gpus": 1}]}, "unknown node 'ghost'"),
    ({"nodes": [{"name": "a", "gpu_model": "H100", "gpus": 2}],
      "workloads": [{"name": "w", "node": "a", "gpus": 4}]}, "more GPUs than it has"),
    ({"change": {"kernel": "6.8"}}, "unknown key 'kernel'"),
    ({"limits": {"max_unavailable": "0%"}}, "lets no node upgrade"),
    (["not", "a", "mapping"], "is not a mapping"),
])
def test_bad_inventories_are_one_line_config_errors(data: object, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        inventory_from_dict(data)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_missing_and_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read inventory"):
        load_inventory(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [\n  {name: a\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_inventory(broken)


def node(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                  "nvidia.com/cuda.driver.major": "570",
                                                  "nvidia.com/cuda.driver.minor": "172",
                                                  "nvidia.com/cuda.driver.rev": "08",
                                                  "nvidia.com/cuda.runtime.major": "12",
                                                  "nvidia.com/cuda.runtime.minor": "8", **labels},
                         "annotations": {"gpucanary.io/engine-version": "vllm-0.10.1"}},
            "status": {"capacity": {"nvidia.com/gpu": "8", "cpu": "96"}}}


def pod(name: str, node_name: str, gpus: int, **annotations: str) -> dict:
    return {"metadata": {"name": name, "namespace": "serving", "annotations": annotations},
            "spec": {"nodeName": node_name, "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": "Running", "startTime": "2026-05-01T10:00:00Z"}}


def test_cluster_dicts_become_a_fleet_with_versions_from_gfd_labels_and_annotations() -> None:
    record = json.dumps({"driver": "570.172.08", "cuda": "12.8", "engine": "vllm-0.10.1",
                         "gpu_model": "NVIDIA-H100-80GB-HBM3"})
    fleet = fleet_from_cluster(
        [node("gpu-1"), node("gpu-2", **{"gpucanary.io/driver-version": "575.57.08"}), {"metadata": {"name": "cpu-1"}}],
        [pod("chat", "gpu-1", 4, **{CHECKPOINT_VERSIONS_ANNOTATION: record, RESTORE_SECONDS_ANNOTATION: "63",
                                    COLD_START_SECONDS_ANNOTATION: "1218", REMAINING_SECONDS_ANNOTATION: "7200"}),
         pod("web", "cpu-1", 0), pod("plain", "gpu-2", 1)],
        now=NOW)
    assert [n.name for n in fleet.nodes] == ["gpu-1", "gpu-2"]
    assert fleet.nodes[0].versions == VersionSet("570.172.08", "12.8", "vllm-0.10.1", None)
    assert fleet.nodes[1].versions.driver == "575.57.08" and fleet.nodes[0].gpus == 8
    chat, plain = fleet.workloads
    assert chat.name == "serving/chat" and chat.checkpoint == VersionSet("570.172.08", "12.8", "vllm-0.10.1")
    assert (chat.restore_s, chat.cold_start_s, chat.remaining_s, chat.since_start_s) == (63, 1218, 7200, 7200)
    assert plain.checkpoint is None and plain.restore_s == 60 and plain.remaining_s is None


def test_a_checkpoint_from_another_gpu_model_does_not_count() -> None:
    record = json.dumps({"driver": "570.172.08", "gpu_model": "NVIDIA-A100-SXM4-80GB"})
    fleet = fleet_from_cluster([node("gpu-1")], [pod("p", "gpu-1", 1, **{CHECKPOINT_VERSIONS_ANNOTATION: record})],
                               now=NOW)
    assert fleet.workloads[0].checkpoint is None


@pytest.mark.parametrize(("annotations", "says"), [
    ({CHECKPOINT_VERSIONS_ANNOTATION: "{driver: 570"}, "is not JSON"),
    ({CHECKPOINT_VERSIONS_ANNOTATION: '{"kernel": "6.8"}'}, "unknown key 'kernel'"),
    ({RESTORE_SECONDS_ANNOTATION: "soon"}, "is not seconds"),
])
def test_bad_pod_annotations_name_the_pod_and_the_key(annotations: dict, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        fleet_from_cluster([node("gpu-1")], [pod("p", "gpu-1", 1, **annotations)], now=NOW)
    assert "serving/p" in str(caught.value) and says in str(caught.value)


def test_snake_case_dicts_from_the_python_client_load_too() -> None:
    raw = {"metadata": {"name": "p", "namespace": "ns", "annotations": None},
           "spec": {"node_name": "gpu-1", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "2"}}}]},
           "status": {"phase": "Running", "start_time": datetime(2026, 5, 1, 11, 0, tzinfo=timezone.utc)}}
    fleet = fleet_from_cluster([node("gpu-1")], [raw], now=NOW)
    assert fleet.workloads[0].since_start_s == 3600 and fleet.workloads[0].gpus == 2


def test_on_a_dra_cluster_slices_count_a_nodes_gpus_and_allocated_claims_a_pods() -> None:
    """A GPUCluster node has no nvidia.com/gpu: its gpu.nvidia.com slices say how many GPUs it has, and a pod that
    claims its GPUs (an allocated claim, admin access left out) is a workload of as many."""
    dra_node = node("gpu-dra")
    dra_node["status"] = {"capacity": {}}
    dra_node["metadata"]["labels"].pop("nvidia.com/gpu.count", None)
    slices = [{"spec": {"driver": "gpu.nvidia.com", "nodeName": "gpu-dra", "devices": [{"name": f"gpu-{i}"}
                                                                                         for i in range(4)]}},
              {"spec": {"driver": "rdma.example.com", "nodeName": "gpu-dra", "devices": [{"name": "nic-0"}]}}]
    claimer = pod("trainer", "gpu-dra", 0)
    claimer["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "two"}]
    claimer["status"]["resourceClaimStatuses"] = [{"name": "gpus", "resourceClaimName": "trainer-gpus-x"}]
    watcher = pod("monitor", "gpu-dra", 0)
    watcher["spec"]["resourceClaims"] = [{"name": "all", "resourceClaimName": "monitor-all"}]

    def claim(name: str, admin: bool) -> dict:
        return {"metadata": {"name": name, "namespace": "serving"}, "status": {"allocation": {"devices": {"results": [
            {"driver": "gpu.nvidia.com", "device": f"gpu-{i}", **({"adminAccess": True} if admin else {})}
            for i in range(2)]}}}}

    fleet = fleet_from_cluster([dra_node], [claimer, watcher], now=NOW,
                               claims=[claim("trainer-gpus-x", False), claim("monitor-all", True)], slices=slices)

    assert [(n.name, n.gpus) for n in fleet.nodes] == [("gpu-dra", 4)]
    assert [(w.name, w.gpus) for w in fleet.workloads] == [("serving/trainer", 2)]
