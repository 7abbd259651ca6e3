"""Install the real GPU Operator into the fleet: its CRDs, namespace, ClusterPolicy and NVIDIADriver,
then wait until the driver, device-plugin and validator pods are Ready on every GPU node."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import yaml

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet import waits
from pytest_gpucanary.fleet.components import OPERATOR_NAMESPACE
from pytest_gpucanary.fleet.manifests import FLEET_FIXTURES
from pytest_gpucanary.kube import Kube

Kubectl = Callable[..., str]
CRDS = ("nvidia.com_clusterpolicies.yaml", "nvidia.com_nvidiadrivers.yaml")
# The DaemonSets a GPU node needs before the fleet counts as up, by their pods' app label.
READY_APPS = ("nvidia-driver", "nvidia-device-plugin-daemonset", "nvidia-operator-validator")
READY_TIMEOUT_S = 240


def install_crds(kubectl: Kubectl, crd_dir: Path) -> None:
    for name in CRDS:
        kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=gpucanary-fleet",
                "-f", str(crd_dir / name))
    kubectl("wait", "--for=condition=Established", "--timeout=60s",
            *(f"crd/{name.removesuffix('.yaml').split('_', 1)[1]}.nvidia.com" for name in CRDS))
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE, "labels": {
        "pod-security.kubernetes.io/enforce": "privileged"}}}
    kubectl("apply", "--server-side", "--field-manager=gpucanary-fleet", "-f", "-", stdin=json.dumps(namespace))


def apply_policies(kubectl: Kubectl, *, driver_mode: str) -> None:
    """NVIDIADriver mode: the ClusterPolicy plus the NVIDIADriver "fleet". ClusterPolicy mode: the same
    ClusterPolicy with useNvidiaDriverCRD off, so its own driver DaemonSet drives every GPU node."""
    policy = yaml.safe_load((FLEET_FIXTURES / "clusterpolicy.yaml").read_text())
    policy["spec"]["driver"]["useNvidiaDriverCRD"] = driver_mode == "nvidiadriver"
    apply = ("apply", "--server-side", "--force-conflicts", "--field-manager=gpucanary-fleet", "-f")
    kubectl(*apply, "-", stdin=json.dumps(policy))
    if driver_mode == "nvidiadriver":
        kubectl(*apply, str(FLEET_FIXTURES / "nvidiadriver.yaml"))


def ready_timeout_s(gpu_nodes: int) -> float:
    """240 s for a handful of nodes; the DaemonSet controller, scheduler and kwok add work per node."""
    return READY_TIMEOUT_S + 0.5 * gpu_nodes


def wait_ready(kube: Kube, gpu_nodes: list[str], progress: Callable[[str], None]) -> None:
    """Bounded wait (setup only) until the operator's pods are Ready on every GPU node, then its ClusterPolicy."""
    timeout_s = ready_timeout_s(len(gpu_nodes))
    started = time.monotonic()
    wanted: set = {(app, node) for app in READY_APPS for node in gpu_nodes}
    try:
        waits.wait_all(kube, "v1", "Pod", namespace=OPERATOR_NAMESPACE, wanted=wanted, timeout_s=timeout_s,
                       satisfies=lambda pod: [(_app(pod), pod["spec"].get("nodeName"))] if _is_ready(pod) else [],
                       progress=progress, what="the GPU Operator's pods")
        remaining_s = max(10.0, timeout_s - (time.monotonic() - started))
        kube.wait_for("nvidia.com/v1", "ClusterPolicy", "cluster-policy",
                      lambda policy: policy.get("status", {}).get("state") == "ready", timeout_s=remaining_s)
    except TimeoutError as exc:
        raise EnvError(f"the GPU Operator was not ready after {timeout_s:.0f} s: {str(exc)[:300]}",
                       hint="see the gpu-operator log in the fleet's logs directory") from None


def _app(pod: dict) -> str:
    labels = pod["metadata"].get("labels", {})
    if labels.get("app.kubernetes.io/component") == "nvidia-driver":
        return "nvidia-driver"
    return labels.get("app", "")


def _is_ready(pod: dict) -> bool:
    status = pod.get("status", {})
    statuses = status.get("containerStatuses") or []
    return (status.get("phase") == "Running" and bool(statuses) and all(s.get("ready") for s in statuses)
            and not pod["metadata"].get("deletionTimestamp"))
