"""The NVIDIA GPU Operator's vocabulary: the labels, selectors, resources and image tags it reads and writes.

Pure names and parsing, the one place these strings live. Each comes from the operator's source
(github.com/NVIDIA/gpu-operator and its upgrade library github.com/NVIDIA/k8s-operator-libs,
pkg/upgrade); the file and constant are named beside it. Never talks to a cluster.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# API kinds (api/nvidia/v1/clusterpolicy_types.go, api/nvidia/v1alpha1/nvidiadriver_types.go)
CLUSTER_POLICY = ("nvidia.com/v1", "ClusterPolicy")
NVIDIADRIVER = ("nvidia.com/v1alpha1", "NVIDIADriver")
GPU_CLUSTER = ("nvidia.com/v1alpha1", "GPUCluster")  # v26.7: NVIDIA's DRA driver, instead of a ClusterPolicy
NVIDIADRIVER_CRD = "nvidiadrivers.nvidia.com"

# Node labels. k8s-operator-libs pkg/upgrade/consts.go: UpgradeStateLabelKeyFmt, UpgradeSkipNodeLabelKeyFmt
# with the driver name "gpu"; the states are its UpgradeState* constants.
UPGRADE_STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
SKIP_LABEL = "nvidia.com/gpu-driver-upgrade.skip"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"  # set by NFD rules / the operator (commonGPULabelKey)
GPU_PRESENT_SELECTOR = f"{GPU_PRESENT_LABEL}=true"
# v26.7 internal/consts/consts.go NVIDIADriverOwnerLabel: the NVIDIADriver that drives the node, set by the operator
# (internal/nvidiadriver AssignOwners: the one non-default CR whose nodeSelector picks it, else the default CR)
# and part of every driver DaemonSet's nodeSelector (internal/state/nodepool.go)
DRIVER_OWNER_LABEL = "nvidia.com/gpu-operator.driver.owner"
UPGRADE_REQUIRED = "upgrade-required"
UPGRADE_DONE = "upgrade-done"
UPGRADE_FAILED = "upgrade-failed"
DRAIN_REQUIRED = "drain-required"
POD_DELETION_REQUIRED = "pod-deletion-required"
VALIDATION_REQUIRED = "validation-required"
TERMINAL_STATES = (UPGRADE_DONE, UPGRADE_FAILED)
UPGRADE_STATES = (
    "",
    UPGRADE_REQUIRED,
    "cordon-required",
    "wait-for-jobs-required",
    POD_DELETION_REQUIRED,
    DRAIN_REQUIRED,
    "node-maintenance-required",
    "post-maintenance-required",  # requestor mode only
    "pod-restart-required",
    VALIDATION_REQUIRED,
    "uncordon-required",
    UPGRADE_DONE,
    UPGRADE_FAILED,
)
# The upgrade library's event reason (pkg/upgrade/util.go: GetEventReason, "<DRIVERNAME>DriverUpgrade").
UPGRADE_EVENT_REASON = "GPUDriverUpgrade"

# Resources a GPU pod asks for: the device plugin's nvidia.com/gpu, and MIG profiles nvidia.com/mig-*.
GPU_RESOURCE = "nvidia.com/gpu"
GPU_RESOURCE_PREFIXES = (GPU_RESOURCE, "nvidia.com/mig-")

# Operand pods (assets/state-driver/0500_daemonset.yaml, assets/state-operator-validation/0500_daemonset.yaml).
DRIVER_POD_LABELS = (("app.kubernetes.io/component", "nvidia-driver"), ("app", "nvidia-driver-daemonset"))
DRIVER_COMPONENT_SELECTOR = "app.kubernetes.io/component=nvidia-driver"
VALIDATOR_APP = "nvidia-operator-validator"
VALIDATOR_SELECTOR = f"app={VALIDATOR_APP}"
DEVICE_PLUGIN_APP = "nvidia-device-plugin-daemonset"
# GPUCluster mode (v26.7): NVIDIA's DRA kubelet plugin instead of the device plugin
# (manifests/state-dra-driver/0500_daemonset.yaml); its DRA validator's pods carry VALIDATOR_APP
# (manifests/state-dra-validation/0500_daemonset.yaml), which the upgrade's validation gate selects on.
DRA_KUBELET_PLUGIN_APP = "nvidia-dra-driver-kubelet-plugin"
# k8s-driver-manager drains the kubelet plugin through it after the other operands (v0.12.0 evictKubeletPlugin)
DRA_DRIVER_DEPLOY_LABEL = "nvidia.com/gpu.deploy.dra-driver"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"  # GPU Feature Discovery
DRIVER_VERSION_LABEL = "nvidia.com/cuda.driver-version.full"  # GPU Feature Discovery: the loaded driver

# What k8s-driver-manager does on every driver pod start (cmd/driver-manager/main.go,
# evictAllGPUOperatorComponents / waitForPodsToTerminate / rescheduleGPUOperatorComponents): it pauses
# these node labels, which the operand DaemonSets select on, waits until the operand pods (by `app`)
# are gone, and restores them once the driver is swapped.
OPERAND_DEPLOY_LABELS = tuple(
    f"nvidia.com/gpu.deploy.{operand}"
    for operand in (
        "operator-validator",
        "container-toolkit",
        "device-plugin",
        "gpu-feature-discovery",
        "dcgm-exporter",
        "dcgm",
        "mig-manager",
        "nvsm",
        "sandbox-validator",
        "sandbox-device-plugin",
        "vgpu-device-manager",
        "client",
        "dra-validator",
        "dcgm-dra",
        "dcgm-exporter-dra",
    )
)
OPERAND_APPS = (
    VALIDATOR_APP,
    "nvidia-container-toolkit-daemonset",
    DEVICE_PLUGIN_APP,
    "gpu-feature-discovery",
    "nvidia-dcgm-exporter",
    "nvidia-dcgm",
    "nvidia-dcgm-exporter-dra",
    "nvidia-dcgm-dra",
    "nvidia-mig-manager",
)
PAUSED = "paused-for-driver-upgrade"


# The release: the Helm chart labels the ClusterPolicy it deploys with the chart's appVersion
# (deployments/gpu-operator/templates/clusterpolicy.yaml includes "gpu-operator.labels", _helpers.tpl:
# app.kubernetes.io/version); the operator itself writes its version on no object.
RELEASE_LABEL = "app.kubernetes.io/version"
PROVEN_RELEASES = ("v25.3.4", "v25.10.1", "v26.3.3", "v26.7.0")  # each run end to end on the local fleet
OLDEST_DRIVABLE = (25, 3)  # before it: no drain/podDeletion semantics the canary's policy checks rely on


def release_of(labels: Mapping[str, str]) -> str | None:
    """The operator release a ClusterPolicy's labels name, or None (OLM installs, or a CR applied by hand)."""
    value = labels.get(RELEASE_LABEL, "").strip()
    return value or None


def release_series(release: str) -> tuple[int, int] | None:
    """`v26.7.0` -> (26, 7); None for what is not a release tag (`main-latest`, `v1.0.0-devel`)."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)", release)
    return (int(match[1]), int(match[2])) if match else None


def of_daemonset(meta: Mapping[str, Any]) -> bool:
    """A DaemonSet's pod (the operator's operands among them): it belongs on every node it selects."""
    return any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or [])


def daemonset_node(spec: Mapping[str, Any]) -> str | None:
    """The node a DaemonSet made a pod for, before the scheduler binds it there: the DaemonSet controller
    pins each pod with a required node affinity on the field metadata.name (kubernetes
    pkg/controller/daemon/util.ReplaceDaemonSetPodNodeNameNodeAffinity)."""
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for match in term.get("matchFields") or []:
            values = match.get("values") or []
            if match.get("key") == "metadata.name" and match.get("operator") == "In" and len(values) == 1:
                return values[0]
    return None


def unplaced(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The PodScheduled=False condition of a pod the scheduler could not place (its reason and words), or None."""
    return next(
        (
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "False"
        ),
        None,
    )


def is_driver_pod(labels: Mapping[str, str]) -> bool:
    return any(labels.get(key) == value for key, value in DRIVER_POD_LABELS)


def is_validator_pod(labels: Mapping[str, str]) -> bool:
    return labels.get("app") == VALIDATOR_APP


def is_device_plugin_pod(labels: Mapping[str, str]) -> bool:
    return labels.get("app") == DEVICE_PLUGIN_APP


def is_dra_kubelet_plugin_pod(labels: Mapping[str, str]) -> bool:
    return labels.get("app") == DRA_KUBELET_PLUGIN_APP


def gpus_requested(containers: list[dict]) -> int:
    """GPUs (and MIG slices) a pod's containers request or are limited to."""
    return sum(
        int(value)
        for c in containers
        for key, value in {
            **c.get("resources", {}).get("requests", {}),
            **c.get("resources", {}).get("limits", {}),
        }.items()
        if key.startswith(GPU_RESOURCE_PREFIXES)
    )


NO_DEVICES = ("", "void", "none")


def holds_driver(spec: Mapping[str, Any]) -> str:
    """Why a pod that asks for no GPU still holds the driver ('' when it does not): the runtime hands it
    the devices (NVIDIA_VISIBLE_DEVICES, the nvidia RuntimeClass). Pod deletion does not see it, a drain
    skips it when a DaemonSet owns it, and the driver manager cannot unload the driver while it runs:
    the upgrade failures users report most (NVIDIA/gpu-operator #2570, #2509, #2549, #2166). An image
    whose own environment sets NVIDIA_VISIBLE_DEVICES on a node whose default runtime is nvidia is not
    visible from the spec."""
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    if gpus_requested(containers):
        return ""
    if spec.get("runtimeClassName") == "nvidia":
        return "runtimeClassName nvidia"
    for container in containers:
        for env in container.get("env") or []:
            if env.get("name") == "NVIDIA_VISIBLE_DEVICES" and str(env.get("value", "")).lower() not in NO_DEVICES:
                return f"NVIDIA_VISIBLE_DEVICES={env.get('value')}"
    return ""


def image_tag(image: str) -> str:
    """`nvcr.io/nvidia/driver:580.82.07-ubuntu22.04@sha256:...` -> `580.82.07-ubuntu22.04`; "" without a tag."""
    name = image.split("@", 1)[0]
    return name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""


def driver_version_of_image(image: str) -> str:
    """The driver image tag is `<version>-<os>` (the operator appends the node's OS to the version): the version."""
    return image_tag(image).split("-", 1)[0]


def driver_version_of(pod: Mapping[str, Any]) -> str:
    """The driver version a driver pod runs, from its first tagged container image."""
    images = [c.get("image", "") for c in pod.get("spec", {}).get("containers", [])]
    return next((v for i in images if (v := driver_version_of_image(i))), "")


def image_at_version(image: str, version: str) -> bool:
    return image_tag(image).startswith(version)


def driver_node_selector(driver: Mapping[str, Any]) -> str:
    """The label selector of the nodes an NVIDIADriver drives before v26.7 (every GPU node when it names
    none); from v26.7 the owner label says it (`DRIVER_OWNER_LABEL`)."""
    selector = (driver.get("spec") or {}).get("nodeSelector") or {GPU_PRESENT_LABEL: "true"}
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def is_default_driver(driver: Mapping[str, Any]) -> bool:
    """A default NVIDIADriver (v26.7): it drives every GPU node that no other NVIDIADriver's nodeSelector picks."""
    return bool((driver.get("spec") or {}).get("default"))


# A pod holds GPUs through DRA when it holds a claim with devices allocated by NVIDIA's GPU driver, admin access left
# out: v26.7.0's gpuPodSpecFilter (cmd/gpu-operator/main.go, PodHasNVIDIAGPUClaim).
DRA_GPU_DRIVER = "gpu.nvidia.com"


def claim_names(pod: dict) -> list[str]:
    """The ResourceClaims a pod holds: named in its spec, or made from a template (named in its status)."""
    made = {
        s.get("name"): s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    names = []
    for claim in (pod.get("spec") or {}).get("resourceClaims") or []:
        if name := claim.get("resourceClaimName") or made.get(claim.get("name")):
            names.append(name)
    return names


def allocated_gpus(claim: dict) -> int:
    """Devices allocated to a claim by NVIDIA's GPU driver, admin-access allocations left out."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    return sum(1 for r in results if r.get("driver") == DRA_GPU_DRIVER and not r.get("adminAccess"))
