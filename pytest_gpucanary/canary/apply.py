"""Apply the policy under test and the target driver version to the pool only, and restore both.

Where the operator reads the policy depends on its mode and version:
- NVIDIADriver mode, operator v26.7+: the pool's NVIDIADriver carries its own upgradePolicy;
- NVIDIADriver mode, older operators: the ClusterPolicy's upgradePolicy (cluster-wide), while the
  version moves on the pool's NVIDIADriver only;
- ClusterPolicy mode: the ClusterPolicy's version and policy, with every other node that runs a
  driver pod (or is labelled a GPU node) held back by the operator's skip label.
Every prior value is saved in an annotation on the object it came from, naming the run and what it
wrote, so `gpucanary cleanup` can restore it after a crash.

Invariant: the saved copy never reaches the cluster after the change it undoes. A spec is saved and
changed in one patch (the annotation and the new values); a held-back node gets its skip label and
the annotation saying so in one patch; each restore is one patch that writes the saved value back
and drops the annotation together. A process killed between any two of these writes leaves either
nothing changed, or a change whose undo is on the object itself (see run.py).

Every write carries the resourceVersion it read, so a concurrent change is never overwritten: on a 409
the object is read and judged again (a node's kubelet writes it often).
A run never adopts another run's saved state: it refuses. A restore acts only on the annotation of its
own run, and puts a field back only while it still holds the value the canary wrote; a field someone
changed since (an emergency driver change) is left as it is and reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY,
    DRIVER_COMPONENT_SELECTOR,
    GPU_PRESENT_SELECTOR,
    NVIDIADRIVER,
    SKIP_LABEL,
    UPGRADE_REQUIRED,
    UPGRADE_STATE_LABEL,
    image_at_version,
)
from pytest_gpucanary.kube import Kube, patch_as_read
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import saved_run

if TYPE_CHECKING:
    from pytest_gpucanary.canary.pool import Pool

SAVED_SPEC_ANNOTATION = "gpucanary.io/saved-spec"  # JSON: run id, the prior spec values, the values written
SKIP_SET_ANNOTATION = "gpucanary.io/skip-label-set-by"  # JSON: run id, prior upgrade state, prior driver version


@dataclass
class AppliedUpgrade:
    """What `apply` changed, in the order to undo it. Created before the first write, so a restore
    registered with it undoes exactly what an apply cut short got to."""

    run_id: str = ""
    saved: list[tuple[tuple[str, str], str]] = field(default_factory=list)  # (api kind, name) with a saved spec
    skipped_nodes: list[str] = field(default_factory=list)
    operator_namespace: str = ""
    cluster_policy: str | None = None  # ClusterPolicy mode: holds are released only while it is at prior_version
    nvidiadriver: str | None = None  # holds on an NVIDIADriver's nodes: released once its DaemonSets are back
    prior_version: str = ""  # ClusterPolicy mode: the driver version the held-back nodes run
    where: list[str] = field(default_factory=list)  # what went where, for the receipt

    def describe(self) -> str:
        return "; ".join(self.where)


def refuse_foreign(obj: dict, annotation: str, run_id: str) -> None:
    """Exit 6 when another run's saved state is on an object this run would write: never adopt it."""
    other = saved_run(obj, annotation)
    if other is not None and other != run_id:
        meta = obj["metadata"]
        raise EnvError(
            f"{obj.get('kind', 'object')} {meta['name']} carries {annotation} of run {other}, "
            "live or not cleaned up: runs never share what they change",
            hint=f"wait for it, or run `gpucanary cleanup --run-id {other}` (it refuses a live run), then retry",
        )


def _save_and_patch(
    kube: Kube, kind: tuple[str, str], name: str, spec_patch: dict, prior: dict, applied: AppliedUpgrade, run_id: str
) -> None:
    """The saved spec and the change in one write: the object never carries one without the other."""
    saved = json.dumps({"run_id": run_id, "spec": prior, "wrote": spec_patch})

    def decide(obj: dict) -> tuple[dict, bool]:
        refuse_foreign(obj, SAVED_SPEC_ANNOTATION, run_id)
        return {"metadata": {"annotations": {SAVED_SPEC_ANNOTATION: saved}}, "spec": spec_patch}, True

    if not patch_as_read(kube, *kind, name, decide, what=f"{kind[1]} {name}", hint="run again"):
        raise EnvError(f"{kind[1]} {name} was deleted while the run changed it", hint="is the GPU Operator ready?")
    applied.saved.append((kind, name))
    knobs = spec_patch.get("driver", spec_patch)
    applied.where.append(f"{kind[1]} {name}: {' and '.join(sorted(knobs))}")


RESTART_LABEL = "gpucanary.io/restart"  # on the pool's driver pods when the run keeps the driver version


def apply(
    kube: Kube,
    cluster: ClusterInfo,
    pool: Pool,
    upgrade_policy: dict,
    *,
    driver_to: str,
    run_id: str,
    applied: AppliedUpgrade | None = None,
) -> AppliedUpgrade:
    applied = applied if applied is not None else AppliedUpgrade()
    applied.run_id = run_id
    if cluster.nvidiadriver_mode:
        if not cluster.per_driver_policy:
            apply_cluster_policy(kube, cluster, {"upgradePolicy": upgrade_policy}, applied, run_id)
        apply_nvidiadriver(kube, cluster, pool, upgrade_policy, driver_to=driver_to, applied=applied, run_id=run_id)
        return applied
    applied.operator_namespace, applied.cluster_policy = cluster.operator_namespace, cluster.cluster_policy
    applied.prior_version = pool.driver_from
    for name, node in driver_nodes(kube).items():  # a fresh list: nodes that joined since preflight too
        if name not in pool.nodes:
            hold_back(kube, node, applied, run_id)
    apply_cluster_policy(kube, cluster, {"upgradePolicy": upgrade_policy, "version": driver_to}, applied, run_id)
    return applied


def apply_nvidiadriver(
    kube: Kube,
    cluster: ClusterInfo,
    pool: Pool,
    upgrade_policy: dict,
    *,
    driver_to: str,
    applied: AppliedUpgrade,
    run_id: str,
) -> None:
    """The pool NVIDIADriver's part of `apply`: the version (and from v26.7, the policy), saved and changed in one
    write. Before v26.7 it follows the ClusterPolicy's policy, the run's first write."""
    assert pool.driver is not None, "an NVIDIADriver-mode pool always names its NVIDIADriver"
    driver_spec = kube.get(*NVIDIADRIVER, pool.driver)["spec"]
    # the same version: the change under test is one that leaves the driver as it is (as a chart bump
    # relabelling the driver pods does), which v26.7+ turns into an in-place restart
    patch: dict = (
        {"version": driver_to}
        if driver_to != pool.driver_from
        else {"labels": {**(driver_spec.get("labels") or {}), RESTART_LABEL: run_id}}
    )
    if cluster.per_driver_policy:
        patch["upgradePolicy"] = upgrade_policy
    prior = {key: driver_spec.get(key) for key in patch}
    _save_and_patch(kube, NVIDIADRIVER, pool.driver, patch, prior, applied, run_id)


def apply_cluster_policy(
    kube: Kube, cluster: ClusterInfo, driver_patch: dict, applied: AppliedUpgrade, run_id: str
) -> None:
    driver_spec = kube.get(*CLUSTER_POLICY, cluster.policy_name)["spec"]["driver"]
    prior = {"driver": {key: driver_spec.get(key) for key in driver_patch}}
    _save_and_patch(kube, CLUSTER_POLICY, cluster.policy_name, {"driver": driver_patch}, prior, applied, run_id)


def driver_nodes(kube: Kube) -> dict[str, dict]:
    """The metadata of every node the ClusterPolicy's driver reaches: labelled a GPU node, or running a driver
    pod (NFD may label a new node late; its driver pod shows it). Read a page at a time."""
    nodes = {
        n["metadata"]["name"]: {"metadata": n["metadata"]}
        for n in kube.each("v1", "Node", label_selector=GPU_PRESENT_SELECTOR)
    }
    for pod in kube.each("v1", "Pod", label_selector=DRIVER_COMPONENT_SELECTOR):
        name = (pod.get("spec") or {}).get("nodeName")
        if name and name not in nodes:
            try:
                nodes[name] = {"metadata": kube.get("v1", "Node", name)["metadata"]}
            except NotFound:
                pass  # a driver pod of a node already gone
    return nodes


def hold_back(kube: Kube, node_obj: dict, applied: AppliedUpgrade, run_id: str) -> None:
    """The skip label keeps the node in upgrade-required; its prior state is saved to put back. A node that
    changed since it was listed (its kubelet writes it often) is read and judged again."""
    name = node_obj["metadata"]["name"]

    def decide(node: dict) -> tuple[dict | None, bool]:
        refuse_foreign({"kind": "Node", **node}, SKIP_SET_ANNOTATION, run_id)
        labels = node["metadata"].get("labels") or {}
        if labels.get(SKIP_LABEL) == "true":
            return None, False  # someone else holds it back already; leave their label alone
        saved = json.dumps(
            {
                "run_id": run_id,
                "state": labels.get(UPGRADE_STATE_LABEL, ""),
                "version": applied.prior_version,
                "namespace": applied.operator_namespace,
                "cluster_policy": applied.cluster_policy,
                "nvidiadriver": applied.nvidiadriver,
            }
        )
        return {"metadata": {"labels": {SKIP_LABEL: "true"}, "annotations": {SKIP_SET_ANNOTATION: saved}}}, True

    if patch_as_read(kube, "v1", "Node", name, decide, what=f"node {name}", hint="run again", read=node_obj):
        applied.skipped_nodes.append(name)


def restore(kube: Kube, applied: AppliedUpgrade, *, report: Callable[[str], None] = print) -> None:
    for kind, name in reversed(applied.saved):
        if line := restore_saved_spec(kube, kind, name, applied.run_id):
            report(line)
    applied.saved.clear()
    if applied.skipped_nodes:
        release_holds(
            kube,
            applied.run_id,
            applied.skipped_nodes,
            applied.prior_version,
            applied.operator_namespace,
            cluster_policy=applied.cluster_policy,
            nvidiadriver=applied.nvidiadriver,
            report=report,
        )
        applied.skipped_nodes.clear()


def release_holds(
    kube: Kube,
    run_id: str,
    nodes: list[str],
    version: str,
    namespace: str | None,
    *,
    cluster_policy: str | None = None,
    nvidiadriver: str | None = None,
    timeout_s: float = 120.0,
    report: Callable[[str], None] = print,
) -> int:
    """Held-back nodes wait in upgrade-required. Once the driver DaemonSet is back at their version their
    pods are in sync again, and putting their prior state back spares them a pointless cordon-and-evict
    cycle when the skip label goes. Released only then; a wait that runs out leaves them held (EnvError).
    With `cluster_policy`, also only while that ClusterPolicy's driver version is theirs again; with
    `nvidiadriver`, only that NVIDIADriver's DaemonSets are waited for. Returns how many it released."""
    if cluster_policy is not None:
        now = ((kube.get(*CLUSTER_POLICY, cluster_policy).get("spec") or {}).get("driver") or {}).get("version")
        if now != version:
            raise EnvError(
                f"ClusterPolicy {cluster_policy} is at driver {now}, not {version} that "
                f"{len(nodes)} held nodes run: they stay held",
                hint="set the ClusterPolicy's driver version back, then run `gpucanary cleanup` again",
            )
    wait_driver_daemonsets(kube, namespace, version, timeout_s=timeout_s, owner=nvidiadriver)
    released = 0
    for node in nodes:
        if release_hold(kube, node, run_id):
            report(f"released the upgrade hold on node {node}")
            released += 1
    return released


def restore_saved_spec(kube: Kube, kind: tuple[str, str], name: str, run_id: str) -> str | None:
    """Put back what `run_id` changed on the object, field by field, each only while it still holds what the
    run wrote; drop the run's annotation. A line saying what was done, or None when nothing of the run is there
    (or the object went away, e.g. a kwok pool's own NVIDIADriver)."""

    def decide(obj: dict) -> tuple[dict | None, str | None]:
        if saved_run(obj, SAVED_SPEC_ANNOTATION) != run_id:
            return None, None
        saved = saved_json(obj, SAVED_SPEC_ANNOTATION)
        prior, wrote = saved.get("spec") or {}, saved.get("wrote")
        current = obj.get("spec") or {}
        patch: dict = {}
        kept = []
        for path in _set_paths(prior):
            if wrote is not None and not _holds(_dig(current, path), _dig(wrote, path)):
                kept.append(".".join(path))
                continue
            _put(patch, path, _exactly(_dig(current, path), _dig(prior, path)))
        line = f"restored {kind[1]} {name}"
        if kept:
            line += f"; left spec.{', spec.'.join(kept)} as it is: changed since the canary wrote it"
        return {"spec": patch, "metadata": {"annotations": {SAVED_SPEC_ANNOTATION: None}}}, line

    return patch_as_read(kube, *kind, name, decide, what=f"{kind[1]} {name}")


def saved_json(obj: dict, annotation: str) -> dict:
    raw = (obj["metadata"].get("annotations") or {}).get(annotation, "")
    try:
        saved = json.loads(raw)
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise EnvError(
            f"{obj.get('kind', 'object')} {obj['metadata']['name']}: {annotation} is not what the "
            "canary writes; left as it is",
            hint="look at the annotation and remove it by hand",
        )
    return saved


def _set_paths(prior: dict) -> list[tuple[str, ...]]:
    """The spec fields `apply` set, as paths: the ClusterPolicy's under `driver`, an NVIDIADriver's at the top."""
    if set(prior) == {"driver"} and isinstance(prior["driver"], dict):
        return [("driver", key) for key in prior["driver"]]
    return [(key,) for key in prior]


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _put(patch: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        patch = patch.setdefault(key, {})
    patch[path[-1]] = value


def _holds(current: Any, wrote: Any) -> bool:
    """Whether a field still holds what the canary wrote (fields the apiserver defaulted beside it aside)."""
    if isinstance(wrote, dict):
        return isinstance(current, dict) and all(_holds(current.get(k), v) for k, v in wrote.items())
    return current == wrote


def _exactly(current: Any, saved: Any) -> Any:
    """The merge patch (RFC 7386) that makes `current` equal `saved`: objects merge, so a key the saved value
    did not have would keep the canary's value; it is nulled."""
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return saved
    return {
        **{key: None for key in current if key not in saved},
        **{key: _exactly(current.get(key), value) for key, value in saved.items()},
    }


def release_hold(kube: Kube, node: str, run_id: str) -> bool:
    """Drop the skip label this run set, putting back the upgrade state saved with it where the operator moved
    the node to upgrade-required meanwhile; anything else on the node is left. False when the run holds nothing
    there (released already, or the node is gone)."""

    def decide(obj: dict) -> tuple[dict | None, bool]:
        if saved_run(obj, SKIP_SET_ANNOTATION) != run_id:
            return None, False
        prior_state = saved_json(obj, SKIP_SET_ANNOTATION).get("state", "")
        current = obj["metadata"].get("labels") or {}
        labels: dict = {}
        if current.get(SKIP_LABEL) == "true":
            labels[SKIP_LABEL] = None
        if prior_state and current.get(UPGRADE_STATE_LABEL) == UPGRADE_REQUIRED:
            labels[UPGRADE_STATE_LABEL] = prior_state
        return {"metadata": {"labels": labels, "annotations": {SKIP_SET_ANNOTATION: None}}}, True

    return bool(patch_as_read(kube, "v1", "Node", node, decide, what=f"node {node}'s hold"))


def wait_driver_daemonsets(
    kube: Kube, namespace: str | None, version: str, *, timeout_s: float = 120.0, owner: str | None = None
) -> None:
    """Watch (bounded) until every driver DaemonSet (of NVIDIADriver `owner`, when given) has its template at
    `version` and its controller caught up."""

    def done(dss: dict[str, dict]) -> bool | None:
        dss = {
            k: d
            for k, d in dss.items()
            if owner is None
            or any(
                ref.get("kind") == NVIDIADRIVER[1] and ref.get("name") == owner
                for ref in d["metadata"].get("ownerReferences") or []
            )
        }
        return True if dss and all(_at_version(d, version) for d in dss.values()) else None

    try:
        kube.watch_until(
            "apps/v1",
            "DaemonSet",
            done,
            timeout_s=timeout_s,
            namespace=namespace,
            label_selector=DRIVER_COMPONENT_SELECTOR,
        )
    except TimeoutError:
        raise EnvError(
            f"the driver DaemonSet did not return to {version} within {timeout_s:.0f} s",
            hint="check the ClusterPolicy, then run `gpucanary cleanup`",
        ) from None


def _at_version(ds: dict, version: str) -> bool:
    images = [c.get("image", "") for c in ds["spec"]["template"]["spec"].get("containers", [])]
    synced = ds.get("status", {}).get("observedGeneration") == ds["metadata"].get("generation")
    return synced and any(image_at_version(image, version) for image in images)
