"""The collective probe's pure parts and its choice of nodes, on the Kubernetes double."""

from __future__ import annotations

import pytest
from kube_double import FakeKube

from pytest_gpucanary.canary.collective import CollectiveProbe, busbw_of, check_peer, choose_pair
from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.canary.workloads import Placement, collective_pod
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.gpu_operator import DRIVER_VERSION_LABEL, GPU_RESOURCE
from pytest_gpucanary.kube.ownership import OWNER_LABEL, RUN_ID_LABEL

OLD = "580.82.07"


def test_the_figure_is_nccl_tests_last_average_bus_bandwidth_line() -> None:
    output = ("#  size  count  type  redop  time  algbw  busbw\n 1048576 262144 float sum 80.2 13.07 13.07 0\n"
              "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 13.071 \n#\n")
    assert busbw_of(output) == 13.071
    assert busbw_of("# Avg bus bandwidth : 1\n# Avg bus bandwidth : 2.5\n") == 2.5
    assert busbw_of("NCCL WARN connect failed\n") is None


def _env(pod: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_each_rank_is_told_its_rank_and_rank_0s_address_unless_the_manifest_says(tmp_path) -> None:
    placement = Placement("gpucanary-r", "r", "canary-r-0")
    rank0 = collective_pod(None, placement, when="after", rank=0, node="canary-r-0", master_addr="")
    rank1 = collective_pod(None, placement, when="after", rank=1, node="gpu-peer", master_addr="10.0.0.7")
    assert rank0["metadata"]["name"] == "collective-after-0" and rank0["metadata"]["namespace"] == "gpucanary-r"
    assert rank1["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-peer"}
    assert _env(rank0) == {"GPUCANARY_MASTER_ADDR": {"fieldRef": {"fieldPath": "status.podIP"}},
                           "GPUCANARY_WORLD_SIZE": "2", "GPUCANARY_MASTER_PORT": "29500", "GPUCANARY_RANK": "0"}
    assert _env(rank1)["GPUCANARY_MASTER_ADDR"] == "10.0.0.7" and _env(rank1)["GPUCANARY_RANK"] == "1"
    own = tmp_path / "probe.yaml"
    own.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n  - name: c\n    image: i\n"
                   "    env: [{name: GPUCANARY_MASTER_ADDR, value: 127.0.0.1}, {name: GPUCANARY_RANK, value: '9'}]\n")
    mine = collective_pod(own, placement, when="baseline", rank=1, node="n", master_addr="10.0.0.7")
    assert _env(mine) == {"GPUCANARY_MASTER_ADDR": "127.0.0.1", "GPUCANARY_WORLD_SIZE": "2",
                          "GPUCANARY_MASTER_PORT": "29500", "GPUCANARY_RANK": "1"}
    own.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(ConfigError, match="holds no Pod"):
        collective_pod(own, placement, when="baseline", rank=0, node="n", master_addr="")


def _node(name: str, *, driver: str = OLD, gpus: str = "8", ready: str = "True", **extra: object) -> dict:
    labels = {DRIVER_VERSION_LABEL: driver, **extra.pop("labels", {})}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": dict(extra), "status": {"allocatable": {GPU_RESOURCE: gpus},
                                            "conditions": [{"type": "Ready", "status": ready}]}}


def _gpu_pod(name: str, node: str, gpus: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "team"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}]},
            "status": {"phase": "Running"}}


def _kube(*objects: dict) -> FakeKube:
    return FakeKube.holding({("v1", o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
                             for o in objects})


POOL = Pool(("canary-r-0",), None, OLD)


def test_a_one_node_pool_takes_the_first_ready_untainted_peer_on_its_driver_with_a_free_gpu() -> None:
    kube = _kube(_node("canary-r-0"), _node("a-full", gpus="2"), _gpu_pod("busy", "a-full", 2),
                 _node("b-new-driver", driver="580.95.05"), _node("c-not-ready", ready="False"),
                 _node("d-tainted", taints=[{"key": "k", "effect": "NoSchedule"}]),
                 _node("da-gpu-taint", driver="580.95.05", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]),
                 _node("e-cordoned", unschedulable=True), _node("f-other-pool", labels={OWNER_LABEL: "gpucanary"}),
                 _node("fa-carved-by-a-run", labels={RUN_ID_LABEL: "other-run"}),
                 _node("g-peer", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"},
                                         {"key": "soft", "effect": "PreferNoSchedule"}]))
    assert choose_pair(kube, POOL, Settings()) == (("canary-r-0", "g-peer"), "")
    pair, note = choose_pair(_kube(_node("canary-r-0"), _node("a-full", gpus="0")), POOL, Settings())
    assert pair is None and note.startswith(f"no peer node for the collective probe: none Ready, schedulable, on "
                                            f"driver {OLD} with a free GPU and no taint the probe does not tolerate")
    assert choose_pair(kube, POOL, Settings(peer_node="none")) == (
        None, "collective probe off (--gpucanary-peer-node=none)")
    assert choose_pair(kube, POOL, Settings(peer_node="a-full")) == (("canary-r-0", "a-full"), "")
    assert choose_pair(kube, Pool(("canary-r-0", "canary-r-1"), None, OLD), Settings()) == (("canary-r-0", "canary-r-1"), "")


def test_on_a_real_cluster_a_peer_outside_the_pool_is_used_only_when_named(tmp_path) -> None:
    kube = _kube(_node("canary-r-0"), _node("g-peer"))
    real = tmp_path / "kubeconfig"
    pair, note = choose_pair(kube, POOL, Settings(kubeconfig=real))
    assert pair is None and note.startswith("no peer node outside the pool on a real cluster unless named "
                                            "(--gpucanary-peer-node=NODE)")
    assert choose_pair(kube, POOL, Settings(kubeconfig=real, peer_node="g-peer")) == (("canary-r-0", "g-peer"), "")


def test_a_named_peer_is_checked_before_the_run_writes_anything() -> None:
    kube = _kube(_node("g-peer"))
    check_peer(kube, Settings(peer_node="g-peer"))
    check_peer(kube, Settings(peer_node="none"))
    with pytest.raises(ConfigError, match="--gpucanary-peer-node=gone: no such node"):
        check_peer(kube, Settings(peer_node="gone"))
    with pytest.raises(ConfigError, match="is the pool node"):
        check_peer(kube, Settings(peer_node="g-peer", pool_node="g-peer"))
    assert kube.writes == []


def _slice(node: str, devices: int) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpu"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": node, "pool": {"name": node, "generation": 1},
                     "devices": [{"name": f"gpu-{i}"} for i in range(devices)]}}


def test_on_a_dra_pool_a_peers_gpus_are_its_slices_devices_less_the_claims_its_pods_hold() -> None:
    """No nvidia.com/gpu on a GPUCluster node: a peer offers the devices of its gpu.nvidia.com slices, and a pod
    holding an allocated claim (admin access left out) uses them."""
    claimed = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer", "namespace": "team"},
               "spec": {"nodeName": "a-dra-full", "resourceClaims": [{"name": "g", "resourceClaimName": "trainer-g"}],
                        "containers": [{"name": "c"}]}, "status": {"phase": "Running"}}
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "trainer-g", "namespace": "team"},
             "status": {"allocation": {"devices": {"results": [
                 {"driver": "gpu.nvidia.com", "pool": "a-dra-full", "device": f"gpu-{i}"} for i in range(2)]}}}}
    kube = _kube(_node("canary-r-0", gpus="0"), _node("a-dra-full", gpus="0"), _node("b-dra-peer", gpus="0"),
                 claimed)
    for made in (_slice("a-dra-full", 2), _slice("b-dra-peer", 8), claim):
        kube.create(made)

    assert choose_pair(kube, POOL, Settings(), dra=True) == (("canary-r-0", "b-dra-peer"), "")
    pair, note = choose_pair(kube, POOL, Settings())                 # by nvidia.com/gpu, none has a free GPU
    assert pair is None and note.startswith("no peer node for the collective probe"), note


def test_on_a_dra_pool_each_rank_claims_its_gpu_from_the_runs_template() -> None:
    kube = _kube(_node("canary-r-0", gpus="0"), _node("b-dra-peer", gpus="0"))
    placement = Placement("gpucanary-r", "r", "canary-r-0")
    probe = CollectiveProbe(kube, placement, ("canary-r-0", "b-dra-peer"), Settings(), claim_gpus=True)

    rank1 = probe._pod(1, "10.0.0.7")

    [container] = rank1["spec"]["containers"]
    assert GPU_RESOURCE not in str(container.get("resources")), container["resources"]
    assert container["resources"]["claims"] == [{"name": f"gpus-{container['name']}"}]
    assert rank1["spec"]["resourceClaims"] == [{"name": f"gpus-{container['name']}",
                                                "resourceClaimTemplateName": "gpucanary-gpus-1"}]
