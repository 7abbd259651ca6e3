"""Install the real GPU Operator into the fleet: its CRDs, namespace, ClusterPolicy (or in GPUCluster mode its
GPUCluster) and NVIDIADriver, then wait until the driver, device-plugin (or DRA kubelet plugin) and validator pods are
Ready on every GPU node.

Everything comes from the tree the running release was built from: every CRD in its Helm chart's
crds/ folder (Helm installs them all; v26.x's controller exits if GPUCluster's is missing), and the
chart's own labels on the ClusterPolicy, which say which release installed it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary.dra import RESOURCE_SLICE
from pytest_gpucanary.canary.pool import DRIVER_POOL_LABEL, HANDOVER_ELIGIBLE_LABEL, POOL_ELIGIBLE_LABEL
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet import waits
from pytest_gpucanary.fleet.components import OPERATOR_NAMESPACE
from pytest_gpucanary.fleet.images import NVML_STATE_PATH
from pytest_gpucanary.fleet.manifests import FLEET_FIXTURES
from pytest_gpucanary.gpu_operator import DRA_KUBELET_PLUGIN_APP, GPU_COUNT_LABEL, GPU_RESOURCE, VALIDATOR_APP
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder.slices import GPU_DRIVER

Kubectl = Callable[..., str]
# v26.7.0 keeps the ClusterPolicy notReady, with only this reason, while any NVIDIADriver-owned node
# upgrades (controllers/clusterpolicy_controller.go:208-213); its operands are ready all the same.
UPGRADE_ONLY_NOT_READY = "ClusterPolicy is not ready; NVIDIADriver upgrade has not completed"
# The DaemonSets a GPU node needs before the fleet counts as up, by their pods' app label.
READY_APPS = ("nvidia-driver", "nvidia-device-plugin-daemonset", VALIDATOR_APP)
# GPUCluster mode: the DRA kubelet plugin instead of the device plugin; the DRA validator's pods carry VALIDATOR_APP
GPU_CLUSTER_READY_APPS = ("nvidia-driver", DRA_KUBELET_PLUGIN_APP, VALIDATOR_APP)
GPU_CLUSTER_NAME = "gpu-cluster"  # fixtures/fleet/gpucluster.yaml, as the chart names it
READY_TIMEOUT_S = 240


def crd_files(crd_dir: Path) -> list[Path]:
    files = sorted(crd_dir.glob("*.yaml"))
    if not any(f.name == "nvidia.com_clusterpolicies.yaml" for f in files):
        raise EnvError(f"no ClusterPolicy CRD in {crd_dir}", hint="rebuild the operator with ci/build-operator.sh")
    return files


def install_crds(kubectl: Kubectl, crd_dir: Path) -> None:
    files = crd_files(crd_dir)
    for path in files:
        kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=gpucanary-fleet", "-f", str(path))
    names = [yaml.safe_load(path.read_text())["metadata"]["name"] for path in files]
    kubectl("wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{name}" for name in names))
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": OPERATOR_NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "privileged"}},
    }
    kubectl("apply", "--server-side", "--field-manager=gpucanary-fleet", "-f", "-", stdin=json.dumps(namespace))


def release_labels(release: str) -> dict[str, str]:
    """The labels the release's Helm chart puts on its ClusterPolicy ("gpu-operator.labels" in
    deployments/gpu-operator/templates/_helpers.tpl), less the ones naming Helm: the fleet installs the
    operator itself. A published chart's version and appVersion are the release tag."""
    return {
        "app.kubernetes.io/name": "gpu-operator",
        "helm.sh/chart": f"gpu-operator-{release}",
        "app.kubernetes.io/version": release,
        "app.kubernetes.io/component": "gpu-operator",
        "app.kubernetes.io/managed-by": "gpucanary-fleet",
    }


# GPUDirect RDMA with the host's MOFED (no Network Operator on the fleet): the operator adds the
# nvidia-peermem-ctr container to every driver pod (assets/state-driver/0500_daemonset.yaml)
RDMA = {"enabled": True, "useHostMofed": True}
# The driver of a kubelet pool node (its NVIDIADriver, or in ClusterPolicy mode the ClusterPolicy's): the driver
# manager reaches the apiserver on 127.0.0.1; the stand-in loads at once, where the default probe waits 60 s.
POOL_DRIVER = {
    "hostNetwork": True,
    "startupProbe": {
        "initialDelaySeconds": 5,
        "periodSeconds": 5,
        "failureThreshold": 60,
        "successThreshold": 1,
        "timeoutSeconds": 30,
    },
}


def pool_operands(apiserver_url: str, device_plugin: dict) -> dict:
    """The ClusterPolicy's validator and device plugin where kubelet nodes are canary pools, so NVIDIA's own run
    there as NVIDIA's GPU-less test stack runs them (k8s-test-infra's gpu-operator values). The validator: no
    /dev/char links to devices that do not exist, no CUDA vectorAdd pod; it reaches the apiserver only by
    in-cluster config, whose kubernetes Service nothing routes here: host network, and the apiserver's own
    address in the env of each check that asks it (the driver's asks who manages the driver, the cuda and plugin
    checks build a client). The device plugin: no NVML event health checks (the stand-in has no events), and the
    NVML stand-in's state read through the host root it mounts. And no CDI (v26.7's default turns it on): the
    plugin would write a CDI spec from the driver root's libcuda and ld.so.cache, which the stand-in driver does
    not have; it hands out GPUs by NVIDIA_VISIBLE_DEVICES and device nodes instead, as before CDI. GFD: from the
    device plugin's image (`device_plugin`: its repository, image and version), as NVIDIA ships it; on the host
    network with the apiserver's address, where it writes its NodeFeature for nfd-master."""
    url = urlsplit(apiserver_url)
    api = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": url.hostname},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(url.port)},
    ]
    return {
        "validator": {
            "hostNetwork": True,
            "driver": {"env": [{"name": "DISABLE_DEV_CHAR_SYMLINK_CREATION", "value": "true"}, *api]},
            "cuda": {"env": [{"name": "WITH_WORKLOAD", "value": "false"}, *api]},
            "plugin": {"env": api},
        },
        "devicePlugin": {
            "env": [
                {"name": "DP_DISABLE_HEALTHCHECKS", "value": "all"},
                {"name": "GPUCANARY_NVML_STATE", "value": "/host" + NVML_STATE_PATH},
            ]
        },
        "gfd": {
            "enabled": True,
            **{k: device_plugin[k] for k in ("repository", "image", "version")},
            "hostNetwork": True,
            "env": api,
        },
        "cdi": {"enabled": False},
    }


def apply_policies(
    kubectl: Kubectl,
    *,
    driver_mode: str,
    release: str,
    rdma: bool = False,
    pool_nodes: tuple[str, ...] = (),
    apiserver_url: str = "",
    default_driver: bool = False,
    gpu_cluster: bool = False,
) -> None:
    """With `gpu_cluster`, the GPUCluster (fixtures/fleet/gpucluster.yaml) where the ClusterPolicy would be: NVIDIA's
    DRA driver and DRA validator instead of the toolkit, device plugin and validator (NVIDIADriver mode only, as
    the operator requires). NVIDIADriver mode: the ClusterPolicy plus the NVIDIADriver "fleet" (with `default_driver`,
    the default one, selecting no nodes by label: every GPU node no other picks), and one NVIDIADriver named
    after each of `pool_nodes` (kubelet nodes that are canary pools) that selects only it. ClusterPolicy
    mode: the same ClusterPolicy with useNvidiaDriverCRD off, so its own driver DaemonSet drives every
    GPU node (with `pool_nodes`, the kubelet pool nodes' driver settings for all of them). With `pool_nodes`
    the validator and device plugin are set up to run on them (`pool_operands`, at `apiserver_url`)."""
    policy = yaml.safe_load((FLEET_FIXTURES / "clusterpolicy.yaml").read_text())
    policy["metadata"].setdefault("labels", {}).update(release_labels(release))
    policy["spec"]["driver"]["useNvidiaDriverCRD"] = driver_mode == "nvidiadriver"
    if pool_nodes:
        for operand, settings in pool_operands(apiserver_url, policy["spec"]["devicePlugin"]).items():
            policy["spec"][operand] = policy["spec"].get(operand, {}) | settings
    if driver_mode == "clusterpolicy" and pool_nodes:  # one DaemonSet drives the kubelet pool nodes too
        policy["spec"]["driver"] |= POOL_DRIVER
    driver = yaml.safe_load((FLEET_FIXTURES / "nvidiadriver.yaml").read_text())
    if rdma:
        policy["spec"]["driver"]["rdma"] = driver["spec"]["rdma"] = RDMA
    apply = ("apply", "--server-side", "--force-conflicts", "--field-manager=gpucanary-fleet", "-f")
    if gpu_cluster:
        cluster = yaml.safe_load((FLEET_FIXTURES / "gpucluster.yaml").read_text())
        cluster["metadata"].setdefault("labels", {}).update(release_labels(release))
        if pool_nodes:
            # NVIDIA's kubelet plugin on a kubelet node reads the NVML stand-in's state through the host root it
            # mounts; no gRPC health probes, which the kubelet would send to the pod's address, which nothing on the
            # machine routes to (ci/node/netns-cni), and which must not leave it
            cluster["spec"]["draDriver"]["gpus"] = {
                "kubeletPlugin": {
                    "env": [{"name": "GPUCANARY_NVML_STATE", "value": "/host" + NVML_STATE_PATH}],
                    "healthcheck": {"enabled": False},
                }
            }
        kubectl(*apply, "-", stdin=json.dumps(cluster))
    else:
        kubectl(*apply, "-", stdin=json.dumps(policy))
    if driver_mode == "nvidiadriver":
        fleet = (
            {
                **driver,
                "metadata": {**driver["metadata"], "labels": {HANDOVER_ELIGIBLE_LABEL: "true"}},
                "spec": {**{k: v for k, v in driver["spec"].items() if k != "nodeSelector"}, "default": True},
            }
            if default_driver
            else driver
        )
        kubectl(*apply, "-", stdin=json.dumps(fleet))
        for name in pool_nodes:
            own = {
                **driver,
                "metadata": {**driver["metadata"], "name": name, "labels": {POOL_ELIGIBLE_LABEL: "true"}},
                "spec": {**driver["spec"], "nodeSelector": {DRIVER_POOL_LABEL: name}, **POOL_DRIVER},
            }
            kubectl(*apply, "-", stdin=json.dumps(own))


def ready_timeout_s(gpu_nodes: int) -> float:
    """240 s for a handful of nodes; the DaemonSet controller, scheduler and kwok add work per node."""
    return READY_TIMEOUT_S + 1.0 * gpu_nodes  # 1,000 nodes took about 11 min on 2 cores


def wait_ready(kube: Kube, gpu_nodes: list[str], progress: Callable[[str], None], *, gpu_cluster: bool = False) -> None:
    """Bounded wait (setup only) until the operator's pods are Ready on every GPU node, each node offers its GPUs (the
    device plugin's allocatable, or in GPUCluster mode the DRA kubelet plugin's ResourceSlices), then its
    ClusterPolicy or GPUCluster is ready."""
    timeout_s = ready_timeout_s(len(gpu_nodes))
    started = time.monotonic()
    apps = GPU_CLUSTER_READY_APPS if gpu_cluster else READY_APPS
    wanted: set = {(app, node) for app in apps for node in gpu_nodes}

    def remaining_s() -> float:
        return max(10.0, timeout_s - (time.monotonic() - started))

    try:
        waits.wait_all(
            kube,
            "v1",
            "Pod",
            namespace=OPERATOR_NAMESPACE,
            wanted=wanted,
            timeout_s=timeout_s,
            satisfies=lambda pod: [(_app(pod), pod["spec"].get("nodeName"))] if _is_ready(pod) else [],
            progress=progress,
            what="the GPU Operator's pods",
        )
        if gpu_cluster:
            waits.wait_all(
                kube,
                *RESOURCE_SLICE,
                wanted=set(gpu_nodes),
                timeout_s=remaining_s(),
                satisfies=lambda s: [s["spec"].get("nodeName")] if s["spec"].get("driver") == GPU_DRIVER else [],
                progress=progress,
                what=f"{GPU_DRIVER} ResourceSlices (the DRA kubelet plugin's GPUs)",
            )
            kube.wait_for(*op.GPU_CLUSTER, GPU_CLUSTER_NAME, _state_ready, timeout_s=remaining_s())
            return
        waits.wait_all(
            kube,
            "v1",
            "Node",
            wanted=set(gpu_nodes),
            timeout_s=remaining_s(),
            satisfies=lambda node: [node["metadata"]["name"]] if gpus_allocatable(node) else [],
            progress=progress,
            what=f"{GPU_RESOURCE} allocatable (the device plugin's GPUs)",
        )
        kube.wait_for("nvidia.com/v1", "ClusterPolicy", "cluster-policy", policy_ready, timeout_s=remaining_s())
    except TimeoutError as exc:
        raise EnvError(
            f"the GPU Operator was not ready after {timeout_s:.0f} s: {str(exc)[:300]}",
            hint="see the gpu-operator log in the fleet's logs directory",
        ) from None


def gpus_allocatable(node: dict) -> bool:
    """The node shows as many GPUs as GPU Feature Discovery counted (the device plugin registered them)."""
    count = node["metadata"].get("labels", {}).get(GPU_COUNT_LABEL)
    return count is not None and node.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE) == count


def _state_ready(cr: dict) -> bool:
    return cr.get("status", {}).get("state") == "ready"


def policy_ready(policy: dict) -> bool:
    """Ready, or notReady only because an NVIDIADriver upgrade is under way (v26.7.0 and later), which
    says nothing about whether the operands are deployed."""
    status = policy.get("status", {})
    if status.get("state") == "ready":
        return True
    messages = [
        c.get("message", "")
        for c in status.get("conditions", [])
        if c.get("type") == "Error" and c.get("status") == "True"
    ]
    return status.get("state") == "notReady" and any(m.startswith(UPGRADE_ONLY_NOT_READY) for m in messages)


def _app(pod: dict) -> str:
    labels = pod["metadata"].get("labels", {})
    if labels.get("app.kubernetes.io/component") == "nvidia-driver":
        return "nvidia-driver"
    return labels.get("app", "")


def _is_ready(pod: dict) -> bool:
    status = pod.get("status", {})
    statuses = status.get("containerStatuses") or []
    return (
        status.get("phase") == "Running"
        and bool(statuses)
        and all(s.get("ready") for s in statuses)
        and not pod["metadata"].get("deletionTimestamp")
    )
