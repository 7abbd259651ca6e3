"""Apply the policy under test and the target driver version to the pool only, and restore both.

Where the operator reads the policy depends on its mode and version:
- NVIDIADriver mode, operator v26.7+: the pool's NVIDIADriver carries its own upgradePolicy;
- NVIDIADriver mode, older operators: the ClusterPolicy's upgradePolicy (cluster-wide), while the
  version moves on the pool's NVIDIADriver only;
- ClusterPolicy mode: the ClusterPolicy's version and policy, with every other GPU node held back by
  the operator's skip label.
Every prior value is saved in an annotation on the object it came from, so `gpucanary cleanup` can
restore it after a crash.

Invariant: the saved copy reaches the cluster before the change it undoes. A spec is saved by one
patch of the annotation and changed by a second, later one; a held-back node gets its skip label and
the annotation saying so in one patch; each restore is one patch that writes the saved value back
and drops the annotation together. A process killed between any two of these writes leaves either
nothing changed, or a change whose undo is on the object itself (see run.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY, DRIVER_COMPONENT_SELECTOR, GPU_PRESENT_SELECTOR, NVIDIADRIVER, SKIP_LABEL, UPGRADE_STATE_LABEL,
    image_at_version,
)
from pytest_gpucanary.kube import Kube, NotFound
from pytest_gpucanary.pool import Pool
from pytest_gpucanary.preflight import ClusterInfo

SAVED_SPEC_ANNOTATION = "gpucanary.io/saved-spec"
SKIP_SET_ANNOTATION = "gpucanary.io/skip-label-set-by"      # JSON: run id and the node's prior upgrade state


@dataclass
class AppliedUpgrade:
    """What `apply` changed, in the order to undo it."""

    saved: list[tuple[tuple[str, str], str]] = field(default_factory=list)   # (api kind, name) with a saved spec
    skipped_nodes: list[str] = field(default_factory=list)
    operator_namespace: str = ""
    prior_version: str = ""      # ClusterPolicy mode: the driver version the held-back nodes run
    where: list[str] = field(default_factory=list)   # what went where, for the receipt

    def describe(self) -> str:
        return "; ".join(self.where)


def _save_and_patch(kube: Kube, kind: tuple[str, str], name: str, spec_patch: dict, prior: dict,
                    applied: AppliedUpgrade, run_id: str) -> None:
    annotations = kube.get(*kind, name)["metadata"].get("annotations", {})
    if SAVED_SPEC_ANNOTATION not in annotations:  # a second apply keeps the first, true original
        saved = json.dumps({"run_id": run_id, "spec": prior})
        kube.patch(*kind, name, {"metadata": {"annotations": {SAVED_SPEC_ANNOTATION: saved}}})
    applied.saved.append((kind, name))
    kube.patch(*kind, name, {"spec": spec_patch})
    knobs = spec_patch.get("driver", spec_patch)
    applied.where.append(f"{kind[1]} {name}: {' and '.join(sorted(knobs))}")


RESTART_LABEL = "gpucanary.io/restart"    # on the pool's driver pods when the run keeps the driver version


def apply(kube: Kube, cluster: ClusterInfo, pool: Pool, upgrade_policy: dict, *, driver_to: str,
          run_id: str) -> AppliedUpgrade:
    applied = AppliedUpgrade()
    if cluster.nvidiadriver_mode:
        assert pool.driver is not None, "an NVIDIADriver-mode pool always names its NVIDIADriver"
        driver_spec = kube.get(*NVIDIADRIVER, pool.driver)["spec"]
        # the same version: the change under test is one that leaves the driver as it is (as a chart bump
        # relabelling the driver pods does), which v26.7+ turns into an in-place restart
        patch: dict = ({"version": driver_to} if driver_to != pool.driver_from else
                       {"labels": {**(driver_spec.get("labels") or {}), RESTART_LABEL: run_id}})
        if cluster.per_driver_policy:
            patch["upgradePolicy"] = upgrade_policy
        else:
            _apply_cluster_policy(kube, cluster, {"upgradePolicy": upgrade_policy}, applied, run_id)
        prior = {key: driver_spec.get(key) for key in patch}
        _save_and_patch(kube, NVIDIADRIVER, pool.driver, patch, prior, applied, run_id)
        return applied
    applied.operator_namespace = cluster.operator_namespace
    applied.prior_version = pool.driver_from
    current = _gpu_nodes(kube)        # one list, not a get per node: the only O(nodes) part of a run
    for node in cluster.gpu_nodes:
        if node not in pool.nodes and node in current:
            _hold_back(kube, current[node], applied, run_id)
    _apply_cluster_policy(kube, cluster, {"upgradePolicy": upgrade_policy, "version": driver_to}, applied, run_id)
    return applied


def _apply_cluster_policy(kube: Kube, cluster: ClusterInfo, driver_patch: dict, applied: AppliedUpgrade,
                          run_id: str) -> None:
    driver_spec = kube.get(*CLUSTER_POLICY, cluster.cluster_policy)["spec"]["driver"]
    prior = {"driver": {key: driver_spec.get(key) for key in driver_patch}}
    _save_and_patch(kube, CLUSTER_POLICY, cluster.cluster_policy, {"driver": driver_patch}, prior, applied, run_id)


def _gpu_nodes(kube: Kube) -> dict[str, dict]:
    """Every GPU node's metadata (all that holding back and releasing reads), a page of full nodes at a time."""
    return {n["metadata"]["name"]: {"metadata": n["metadata"]}
            for n in kube.each("v1", "Node", label_selector=GPU_PRESENT_SELECTOR)}


def _hold_back(kube: Kube, node_obj: dict, applied: AppliedUpgrade, run_id: str) -> None:
    """The skip label keeps the node in upgrade-required; its prior state is saved to put back."""
    node = node_obj["metadata"]["name"]
    labels = node_obj["metadata"].get("labels") or {}
    if labels.get(SKIP_LABEL) == "true":
        return  # someone else holds it back already; leave their label alone
    saved = json.dumps({"run_id": run_id, "state": labels.get(UPGRADE_STATE_LABEL, "")})
    kube.patch("v1", "Node", node, {"metadata": {"labels": {SKIP_LABEL: "true"},
                                                 "annotations": {SKIP_SET_ANNOTATION: saved}}})
    applied.skipped_nodes.append(node)


def restore(kube: Kube, applied: AppliedUpgrade) -> None:
    for kind, name in reversed(applied.saved):
        restore_saved_spec(kube, kind, name)
    if applied.skipped_nodes:
        # Held-back nodes wait in upgrade-required. Once the driver DaemonSet is back at their version
        # their pods are in sync again, and putting their prior state back spares them a pointless
        # cordon-and-evict cycle when the skip label goes.
        wait_driver_daemonsets(kube, applied.operator_namespace, applied.prior_version)
    current = _gpu_nodes(kube) if applied.skipped_nodes else {}
    for node in applied.skipped_nodes:
        release_hold(kube, node, current.get(node))
    applied.saved.clear()
    applied.skipped_nodes.clear()


def restore_saved_spec(kube: Kube, kind: tuple[str, str], name: str) -> None:
    try:
        annotations = kube.get(*kind, name)["metadata"].get("annotations", {})
    except NotFound:
        return  # the object went away (e.g. a kwok pool's own NVIDIADriver)
    if SAVED_SPEC_ANNOTATION in annotations:
        prior = json.loads(annotations[SAVED_SPEC_ANNOTATION])["spec"]
        current = kube.get(*kind, name).get("spec", {})
        kube.patch(*kind, name, {"spec": _restoring(current, prior),
                                 "metadata": {"annotations": {SAVED_SPEC_ANNOTATION: None}}})


SET_WHOLE = ("upgradePolicy", "version")   # the spec keys `apply` sets; everything beside them is merged


def _restoring(current: Any, saved: Any) -> Any:
    """The merge patch that puts the saved values back. A merge patch (RFC 7386) merges objects, so a field
    the saved policy did not have would keep the canary's value: under the keys `apply` set, it is nulled."""
    if not isinstance(saved, dict):
        return saved
    current = current if isinstance(current, dict) else {}
    return {key: _exactly(current.get(key), value) if key in SET_WHOLE else _restoring(current.get(key), value)
            for key, value in saved.items()}


def _exactly(current: Any, saved: Any) -> Any:
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return saved
    return {**{key: None for key in current if key not in saved},
            **{key: _exactly(current.get(key), value) for key, value in saved.items()}}


def release_hold(kube: Kube, node: str, node_obj: dict | None = None) -> None:
    """Drop the skip label, putting back the state saved with it; `node_obj` as just listed, else got."""
    node_obj = node_obj or kube.get("v1", "Node", node)
    raw = (node_obj["metadata"].get("annotations") or {}).get(SKIP_SET_ANNOTATION, "{}")
    try:
        prior_state = json.loads(raw).get("state", "")
    except (ValueError, AttributeError):
        prior_state = ""
    labels: dict = {SKIP_LABEL: None}
    if prior_state:
        labels[UPGRADE_STATE_LABEL] = prior_state
    kube.patch("v1", "Node", node, {"metadata": {"labels": labels, "annotations": {SKIP_SET_ANNOTATION: None}}})


def wait_driver_daemonsets(kube: Kube, namespace: str, version: str, *, timeout_s: float = 120.0) -> None:
    """Watch (bounded) until every driver DaemonSet's template is at `version` and its controller caught up."""
    try:
        kube.watch_until("apps/v1", "DaemonSet", lambda dss: True if dss and all(_at_version(d, version) for d in dss.values())
                         else None,
                         timeout_s=timeout_s, namespace=namespace, label_selector=DRIVER_COMPONENT_SELECTOR)
    except TimeoutError:
        raise EnvError(f"the driver DaemonSet did not return to {version} within {timeout_s:.0f} s",
                       hint="check the ClusterPolicy, then run `gpucanary cleanup`") from None


def _at_version(ds: dict, version: str) -> bool:
    images = [c.get("image", "") for c in ds["spec"]["template"]["spec"].get("containers", [])]
    synced = ds.get("status", {}).get("observedGeneration") == ds["metadata"].get("generation")
    return synced and any(image_at_version(image, version) for image in images)
