"""What a sweep writes and how it comes undone, through the canary run's writes (`canary.apply`): every node
held first, then the change; a hold released as its wave starts; the run's saved copy of what the change
replaced dropped once every wave passed; or, on `--rollback`, the change restored, which hands the upgraded
nodes back to the operator's old policy and driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary.cleanup import RunLeftovers
from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.gpu_operator import DRIVER_COMPONENT_SELECTOR, NVIDIADRIVER, SKIP_LABEL, UPGRADE_FAILED
from pytest_gpucanary.kube import Kube, patch_as_read
from pytest_gpucanary.kube.ownership import saved_run
from pytest_gpucanary.widen import state
from pytest_gpucanary.widen.state import FAILED, PASSED, PENDING, ROLLING, SOAKING, Sweep
from pytest_gpucanary.widen.watch import nodes_seen

if TYPE_CHECKING:
    from pytest_gpucanary.widen.options import WidenOptions


def applied(cluster: ClusterInfo, sweep: Sweep, left: RunLeftovers | None) -> upgrade.AppliedUpgrade:
    """What the sweep changed, as the canary's restore reads it: rebuilt from the sweep's record and what its
    run id marks in the cluster (`left`, on a resume), so a resumed sweep undoes what the killed one wrote."""
    applied = upgrade.AppliedUpgrade(
        run_id=sweep.run_id, operator_namespace=cluster.operator_namespace, prior_version=sweep.prior_version
    )
    if cluster.nvidiadriver_mode:
        applied.nvidiadriver = sweep.target[2]
    else:
        applied.cluster_policy = cluster.cluster_policy
    if left is not None:
        applied.saved = list(left.specs)
        applied.skipped_nodes = [node["metadata"]["name"] for node in left.holds]
    return applied


def apply(
    kube: Kube,
    cluster: ClusterInfo,
    opts: WidenOptions,
    sweep: Sweep,
    applied: upgrade.AppliedUpgrade,
    report: Callable[[str], None],
) -> None:
    """Every node held first, then the change: no node can start on the new driver before its wave. Again on a
    resume, writing only what the killed sweep had not (a second saved copy would save the change itself):
    before v26.7 an NVIDIADriver's change is two writes, the ClusterPolicy's policy and then its version."""
    for name in sweep.nodes():
        if not any(w.outcome != PENDING and name in w.nodes for w in sweep.waves):
            upgrade.hold_back(kube, kube.get("v1", "Node", name), applied, sweep.run_id)
    _, kind, name = sweep.target
    if kind == NVIDIADRIVER[1] and (NVIDIADRIVER, name) not in applied.saved:
        pool = Pool(nodes=tuple(sweep.nodes()), driver=name, driver_from=sweep.prior_version)
        write = upgrade.apply_nvidiadriver if applied.saved else upgrade.apply
        write(kube, cluster, pool, opts.upgrade_policy, driver_to=opts.target, run_id=sweep.run_id, applied=applied)
    elif kind != NVIDIADRIVER[1] and not applied.saved:
        upgrade.apply_cluster_policy(
            kube, cluster, {"upgradePolicy": opts.upgrade_policy, "version": opts.target}, applied, sweep.run_id
        )
    else:
        return
    report(
        f"widen: {len(applied.skipped_nodes)} nodes held on driver {sweep.prior_version}; wrote {applied.describe()}"
    )


def release_hold(kube: Kube, node: str, run_id: str) -> bool:
    """Let the operator upgrade a held node: the skip label and the run's note of it go; its upgrade state stays
    (upgrade-required, which the operator takes from there). False when the run holds nothing there."""

    def decide(obj: dict) -> tuple[dict | None, bool]:
        if saved_run(obj, upgrade.SKIP_SET_ANNOTATION) != run_id:
            return None, False
        labels = {SKIP_LABEL: None} if (obj["metadata"].get("labels") or {}).get(SKIP_LABEL) == "true" else {}
        return {"metadata": {"labels": labels, "annotations": {upgrade.SKIP_SET_ANNOTATION: None}}}, True

    return bool(patch_as_read(kube, "v1", "Node", node, decide, what=f"node {node}'s hold"))


def forget_saved_spec(kube: Kube, kind: tuple[str, str], name: str, run_id: str) -> None:
    """The change is the fleet's state now: the run's saved copy of what it replaced goes."""

    def decide(obj: dict) -> tuple[dict | None, bool]:
        if saved_run(obj, upgrade.SAVED_SPEC_ANNOTATION) != run_id:
            return None, False
        return {"metadata": {"annotations": {upgrade.SAVED_SPEC_ANNOTATION: None}}}, True

    patch_as_read(kube, *kind, name, decide, what=f"{kind[1]} {name}")


def roll_back(
    kube: Kube,
    cluster: ClusterInfo,
    sweep: Sweep,
    applied: upgrade.AppliedUpgrade,
    report: Callable[[str], None],
) -> None:
    failed = next(w for w in sweep.waves if w.outcome == FAILED)
    upgraded = [n for w in sweep.waves if w.outcome in (PASSED, FAILED, ROLLING, SOAKING) for n in w.nodes]
    upgrade.restore(kube, applied, report=report)
    sweep.status = state.ROLLED_BACK
    sweep.rollback = (
        f"{sweep.target[1]} {sweep.target[2]} restored to driver {sweep.prior_version} and its earlier "
        f"upgradePolicy; the operator takes {', '.join(upgraded)} (the failed wave: "
        f"{', '.join(failed.nodes)}) back to {sweep.prior_version} under that policy; every held node "
        f"released once the driver DaemonSet was back at {sweep.prior_version}"
    )
    # k8s-operator-libs (ProcessUpgradeFailedNodes) moves an upgrade-failed node on only once its driver pod
    # matches the DaemonSet again: one whose pod the failed upgrade had already replaced waits for a person
    stuck = [
        node
        for node, now in nodes_seen(kube, failed.nodes, cluster.operator_namespace).items()
        if now.state == UPGRADE_FAILED and now.driver == sweep.key.target
    ]
    for node in stuck:
        sweep.rollback += (
            f"; {node} stays {UPGRADE_FAILED} and cordoned, its driver pod at {sweep.key.target}: "
            f"`kubectl delete pod -n {cluster.operator_namespace} -l {DRIVER_COMPONENT_SELECTOR} "
            f"--field-selector spec.nodeName={node}` lets the DaemonSet make one at {sweep.prior_version}"
        )
    report(f"widen: rolled back: {sweep.rollback}")
