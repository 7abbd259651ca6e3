"""The wait for a carved node's driver: until the node runs a given driver version again and is upgrade-done,
with what GPU Operator itself would not do to get it there (a node stranded in validation-required or
upgrade-failed put back into upgrade-required; a driver pod of another version that could not be placed
deleted). Both the run's give-back and `gpucanary cleanup` wait here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.gpu_operator import (
    DRIVER_COMPONENT_SELECTOR,
    DRIVER_OWNER_LABEL,
    UPGRADE_DONE,
    UPGRADE_FAILED,
    UPGRADE_REQUIRED,
    UPGRADE_STATE_LABEL,
    VALIDATION_REQUIRED,
    daemonset_node,
    driver_version_of,
    of_daemonset,
    unplaced,
)
from pytest_gpucanary.kube import Conflict, Kube, NotFound, patch_as_read

# GPU Operator restarts an out-of-date driver pod only on the way from upgrade-required through
# pod-restart-required: in validation-required it waits for the validator alone, in upgrade-failed for the pod
# to be in sync (k8s-operator-libs, ProcessValidationRequiredNodes and ProcessUpgradeFailedNodes). A target
# driver that loaded but never validated, or whose upgrade failed, would stay after its version went back.
STRANDED_STATES = (VALIDATION_REQUIRED, UPGRADE_FAILED)
UNSTRAND_TRIES = 3  # once more if the first came before the operator had put the DaemonSet back
LOOK_EVERY_S = 15  # a stranded node may not change: it is looked at again this often
# A node done and owned while its new driver pod is not running yet: the pod's start changes nothing on the Node
POD_LOOK_EVERY_S = 2


def wait_for_driver(
    kube: Kube, node: str, version: str, *, owner: str = "", timeout_s: float, report: Callable[[str], None] = print
) -> None:
    """Block (watching, bounded) until the node's driver pod runs `version` and the node is upgrade-done (with
    `owner`, also until that NVIDIADriver owns the node and the running driver pod is its DaemonSet's). A node
    stranded on another driver (STRANDED_STATES) is put back into upgrade-required, the state the operator
    itself gives a node whose driver pod is out of date, so it rolls the node back; a driver pod of another
    version that the scheduler could not place there is deleted (`_replace_unplaced`)."""
    tries = {"unstrand": UNSTRAND_TRIES, "unplaced": UNSTRAND_TRIES}
    pod_pending = [False]

    def back(nodes: dict[str, dict]) -> bool | None:
        labels = nodes.get(node, {}).get("metadata", {}).get("labels", {})
        state = labels.get(UPGRADE_STATE_LABEL)
        if state == UPGRADE_DONE and (not owner or labels.get(DRIVER_OWNER_LABEL) == owner):
            if _driver_version_on(kube, node, owner) == version:
                return True
            pod_pending[0] = True
        if state in STRANDED_STATES and tries["unstrand"] and (stale := _other_drivers_on(kube, node, version)):
            tries["unstrand"] -= 1
            if _unstrand(kube, node):
                report(
                    f"node {node} stayed in {state} on driver {', '.join(stale)}, which GPU Operator does not "
                    f"restart there: put it back into {UPGRADE_REQUIRED} to roll it back to {version}"
                )
        if tries["unplaced"] and _replace_unplaced(kube, node, version, report):
            tries["unplaced"] -= 1
        return None

    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            look_s = POD_LOOK_EVERY_S if pod_pending[0] else LOOK_EVERY_S
            pod_pending[0] = False
            kube.watch_until("v1", "Node", back, timeout_s=min(left, look_s), field_selector=f"metadata.name={node}")
            return
        except TimeoutError:
            continue
    under = f" under NVIDIADriver {owner}" if owner else ""
    raise EnvError(
        f"node {node} did not return to driver {version}{under} within {timeout_s:.0f} s",
        hint="check it, then run `gpucanary cleanup` to restore its labels and taints",
    )


def _replace_unplaced(kube: Kube, node: str, version: str, report: Callable[[str], None]) -> bool:
    """Delete the node's driver pods of another version that the scheduler could not place (PodScheduled False):
    GPU Operator passes over a node whose driver pod has no node (k8s-operator-libs BuildState: "Driver Pod has
    no NodeName, skipping"), so nothing else would; the DaemonSet makes a new one from its restored template.
    Such a pod never ran: deleting it disrupts nothing (deploy/admission.yaml allows the canary only such pods
    outside its namespaces). True when one was deleted."""
    deleted = False
    for pod in kube.list("v1", "Pod", label_selector=DRIVER_COMPONENT_SELECTOR, field_selector="spec.nodeName="):
        meta, why, its_version = pod["metadata"], unplaced(pod), driver_version_of(pod)
        if (
            daemonset_node(pod.get("spec") or {}) != node
            or not of_daemonset(meta)
            or why is None
            or meta.get("deletionTimestamp")
            or its_version in ("", version)
        ):
            continue
        try:
            kube.delete("v1", "Pod", meta["name"], namespace=meta["namespace"], uid=meta["uid"])
        except (NotFound, Conflict):
            continue
        deleted = True
        report(
            f"driver pod {meta['namespace']}/{meta['name']} of {its_version} could not be placed on "
            f"node {node} ({' '.join(str(why.get('message', '')).split())[:200]}), and GPU Operator passes over "
            f"a node whose driver pod has no node: deleted it, so that its DaemonSet makes one of {version}"
        )
    return deleted


def _driver_pods_on(kube: Kube, node: str) -> list[dict]:
    """The node's driver pods, but those being deleted."""
    pods = kube.list("v1", "Pod", label_selector=DRIVER_COMPONENT_SELECTOR, field_selector=f"spec.nodeName={node}")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _other_drivers_on(kube: Kube, node: str, version: str) -> list[str]:
    """The versions of the node's driver pods (any phase) that are not `version`."""
    return sorted({v for p in _driver_pods_on(kube, node) if (v := driver_version_of(p)) and v != version})


def _unstrand(kube: Kube, node: str) -> bool:
    def decide(obj: dict) -> tuple[dict | None, bool]:
        if (obj["metadata"].get("labels") or {}).get(UPGRADE_STATE_LABEL) not in STRANDED_STATES:
            return None, False  # the operator moved it on meanwhile
        return {"metadata": {"labels": {UPGRADE_STATE_LABEL: UPGRADE_REQUIRED}}}, True

    return bool(patch_as_read(kube, "v1", "Node", node, decide, what=f"node {node}"))


def _driver_version_on(kube: Kube, node: str, owner: str = "") -> str:
    """The version of the node's one running driver pod (of `owner`'s DaemonSets, whose pods select the nodes
    that NVIDIADriver owns), or ''."""
    ready = [
        p
        for p in _driver_pods_on(kube, node)
        if p.get("status", {}).get("phase") == "Running"
        and (not owner or ((p.get("spec") or {}).get("nodeSelector") or {}).get(DRIVER_OWNER_LABEL) == owner)
    ]
    return driver_version_of(ready[0]) if len(ready) == 1 else ""
