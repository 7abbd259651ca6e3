"""Remove what canary runs left behind, found by label and annotation, also after a crash or kill.

Deletes the namespaces, NVIDIADrivers and simulated nodes the canary created; restores carved-out
nodes, held-back nodes and saved ClusterPolicy/NVIDIADriver specs. Touches nothing else, and never a
run that is still alive (its Lease renewed, see `lease`) unless that run's id is given.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime, timezone
from typing import Callable

from pytest_gpucanary import lease
from pytest_gpucanary.gpu_operator import CLUSTER_POLICY, NVIDIADRIVER
from pytest_gpucanary.kube import OWNER_LABEL, RUN_ID_LABEL, Kube, NotFound
from pytest_gpucanary.policy import apply as upgrade
from pytest_gpucanary.pool.existing_node import SAVED_STATE_ANNOTATION, restore_node


def _run_of(obj: dict, annotation: str) -> str | None:
    """The run id an annotation of ours on `obj` names, or None when it carries none."""
    raw = obj["metadata"].get("annotations", {}).get(annotation)
    if raw is None:
        return None
    try:
        return str(json.loads(raw).get("run_id", raw))
    except (ValueError, AttributeError):
        return raw


def live_runs(kube: Kube, run_ids: set[str]) -> dict[str, lease.LeaseSeen]:
    now = datetime.now(timezone.utc)
    return {run: seen for run in sorted(run_ids) if (seen := lease.read(kube, run)) is not None and seen.live(now)}


def cleanup(kube: Kube, *, run_id: str | None = None, report: Callable[[str], None] = print) -> int:
    """Returns how many objects it deleted or restored. Without a run id: every run whose owner is gone,
    leaving alone (and naming) the runs whose Lease is still renewed."""
    policies = [(kind, obj) for kind in (CLUSTER_POLICY, NVIDIADRIVER) for obj in _list(kube, *kind)]
    nodes = kube.list("v1", "Node")
    owned = [(kind, obj) for kind in (NVIDIADRIVER, ("v1", "Node"), ("v1", "Namespace"))
             for obj in _list(kube, *kind, label_selector=f"{OWNER_LABEL}=gpucanary")]
    found = ({r for _, o in policies if (r := _run_of(o, upgrade.SAVED_SPEC_ANNOTATION))}
             | {r for n in nodes for a in (SAVED_STATE_ANNOTATION, upgrade.SKIP_SET_ANNOTATION) if (r := _run_of(n, a))}
             | {o["metadata"].get("labels", {}).get(RUN_ID_LABEL, "") for _, o in owned})
    alive = {} if run_id else live_runs(kube, found)
    for run, seen in alive.items():
        report(f"left live run {run} alone (held by {seen.holder}, renewed {seen.renewed:%H:%M:%S} UTC)")

    def mine(run: str | None) -> bool:
        return run is not None and (run == run_id if run_id else run not in alive)

    count = 0
    for kind, obj in policies:
        if mine(_run_of(obj, upgrade.SAVED_SPEC_ANNOTATION)):
            upgrade.restore_saved_spec(kube, kind, obj["metadata"]["name"])
            report(f"restored {kind[1]} {obj['metadata']['name']}")
            count += 1
    for node in nodes:
        name = node["metadata"]["name"]
        if mine(_run_of(node, SAVED_STATE_ANNOTATION)):
            restore_node(kube, name)
            report(f"restored node {name}")
            count += 1
        if mine(_run_of(node, upgrade.SKIP_SET_ANNOTATION)):
            upgrade.release_hold(kube, name)
            report(f"released the upgrade hold on node {name}")
            count += 1
    for (api_version, kind), obj in owned:
        meta = obj["metadata"]
        if not mine(meta.get("labels", {}).get(RUN_ID_LABEL)):
            continue
        if kind == "Node" and SAVED_STATE_ANNOTATION in meta.get("annotations", {}):
            continue  # a carved-out node is restored, never deleted
        with contextlib.suppress(NotFound):
            kube.delete(api_version, kind, meta["name"])
            report(f"deleted {kind} {meta['name']}")
            count += 1
    return count


def _list(kube: Kube, api_version: str, kind: str, **selectors: str) -> list[dict]:
    try:
        return kube.list(api_version, kind, **selectors)
    except NotFound:      # the cluster serves no such kind (no NVIDIADriver CRD)
        return []
