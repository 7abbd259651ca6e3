"""Remove what canary runs left behind, found by label and annotation, also after a crash or kill.

Deletes the namespaces, NVIDIADrivers and simulated nodes the canary created; restores carved-out
nodes, held-back nodes and saved ClusterPolicy/NVIDIADriver specs. Touches nothing else.
"""

from __future__ import annotations

import contextlib
import json
from typing import Callable

from pytest_gpucanary.gpu_operator import CLUSTER_POLICY, NVIDIADRIVER
from pytest_gpucanary.kube import OWNER_LABEL, RUN_ID_LABEL, Kube, NotFound
from pytest_gpucanary.policy import apply as upgrade
from pytest_gpucanary.pool.existing_node import SAVED_STATE_ANNOTATION, restore_node


def cleanup(kube: Kube, *, run_id: str | None = None, report: Callable[[str], None] = print) -> int:
    """Returns how many objects it deleted or restored."""
    selector = f"{OWNER_LABEL}=gpucanary" + (f",{RUN_ID_LABEL}={run_id}" if run_id else "")
    count = 0

    def mine(annotation: str, obj: dict) -> bool:
        raw = obj["metadata"].get("annotations", {}).get(annotation)
        if raw is None:
            return False
        with contextlib.suppress(ValueError, AttributeError):
            raw = json.loads(raw).get("run_id", raw)
        return run_id is None or raw == run_id

    for kind in (CLUSTER_POLICY, NVIDIADRIVER):
        with contextlib.suppress(NotFound):
            for obj in kube.list(*kind):
                if mine(upgrade.SAVED_SPEC_ANNOTATION, obj):
                    upgrade.restore_saved_spec(kube, kind, obj["metadata"]["name"])
                    report(f"restored {kind[1]} {obj['metadata']['name']}")
                    count += 1
    for node in kube.list("v1", "Node"):
        name = node["metadata"]["name"]
        if mine(SAVED_STATE_ANNOTATION, node):
            restore_node(kube, name)
            report(f"restored node {name}")
            count += 1
        if mine(upgrade.SKIP_SET_ANNOTATION, node):
            upgrade.release_hold(kube, name)
            report(f"released the upgrade hold on node {name}")
            count += 1
    for api_version, kind in (NVIDIADRIVER, ("v1", "Node"), ("v1", "Namespace")):
        with contextlib.suppress(NotFound):
            for obj in kube.list(api_version, kind, label_selector=selector):
                if kind == "Node" and SAVED_STATE_ANNOTATION in obj["metadata"].get("annotations", {}):
                    continue  # a carved-out node is restored, never deleted
                kube.delete(api_version, kind, obj["metadata"]["name"])
                report(f"deleted {kind} {obj['metadata']['name']}")
                count += 1
    return count
