"""Giving a carved node back: the run's saved state on it (the annotation naming the run, the driver it ran,
the NVSentinel label it changed and the default NVIDIADriver it was handed over from), and the restore that
waits for that driver and then removes exactly the run's label, annotation and fence. The run's release and
`gpucanary cleanup` give nodes back the same way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

from pytest_gpucanary.canary import neighbours
from pytest_gpucanary.canary.pool.driver import wait_for_driver
from pytest_gpucanary.gpu_operator import NVIDIADRIVER
from pytest_gpucanary.kube import Kube, patch_as_read
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import RUN_ID_LABEL, fence_taint, saved_run

SAVED_STATE_ANNOTATION = "gpucanary.io/saved-node-state"


def handover_driver(run_id: str) -> str:
    """The name of the NVIDIADriver a run hands default-driven pool nodes to."""
    return f"gpucanary-{run_id}"


def give_back(
    kube: Kube, name: str, run_id: str, driver: str, *, timeout_s: float, report: Callable[[str], None] = print
) -> bool:
    """Wait for `driver` on the node, then drop the run's label and annotation (only while they name `run_id`).
    A node the run took from the default NVIDIADriver goes back to it first: the run's own NVIDIADriver is
    deleted and the default one's driver pod waited for. False when the node carries nothing of the run."""
    try:
        node = kube.get("v1", "Node", name)
    except NotFound:
        return False
    saved = _saved(node)
    owner = str(saved.get("handover_from") or "") if str(saved.get("run_id")) == run_id else ""
    if owner:
        with contextlib.suppress(NotFound):  # gone already: given back another node of the run
            own = kube.get(*NVIDIADRIVER, handover_driver(run_id))
            if (own["metadata"].get("labels") or {}).get(RUN_ID_LABEL) == run_id:
                kube.delete(*NVIDIADRIVER, handover_driver(run_id), uid=own["metadata"]["uid"])
                report(
                    f"deleted NVIDIADriver {handover_driver(run_id)}: the default NVIDIADriver {owner} takes the "
                    "pool back"
                )
    if driver:
        try:
            wait_for_driver(kube, name, driver, owner=owner, timeout_s=timeout_s, report=report)
        except NotFound:
            return False
    return restore_node(kube, name, run_id)


def _saved(node: dict) -> dict:
    try:
        saved = json.loads(node["metadata"]["annotations"][SAVED_STATE_ANNOTATION])
    except (KeyError, ValueError, TypeError, AttributeError):
        return {}
    return saved if isinstance(saved, dict) else {}


def carved_driver(node: dict) -> str:
    """The driver version a carved node ran when the run took it (saved in its annotation), or ''."""
    return str(_saved(node).get("driver") or "")


def restore_node(kube: Kube, name: str, run_id: str) -> bool:
    """Remove the run's label, annotation and fence from the node and put back the NVSentinel label it changed
    (unless someone changed it since), and nothing else; False when they are not the run's."""

    def decide(node: dict) -> tuple[dict | None, bool]:
        if saved_run(node, SAVED_STATE_ANNOTATION) != run_id:
            return None, False
        now = node["metadata"].get("labels") or {}
        labels = {RUN_ID_LABEL: None} if now.get(RUN_ID_LABEL) == run_id else {}
        saved = json.loads(node["metadata"]["annotations"][SAVED_STATE_ANNOTATION])
        if "nvsentinel" in saved and now.get(neighbours.NVSENTINEL_LABEL) == "false":  # still what the run wrote
            labels[neighbours.NVSENTINEL_LABEL] = saved["nvsentinel"]
        body: dict = {"metadata": {"labels": labels, "annotations": {SAVED_STATE_ANNOTATION: None}}}
        taints = (node.get("spec") or {}).get("taints") or []
        if fence_taint(run_id) in taints:
            body["spec"] = {"taints": [t for t in taints if t != fence_taint(run_id)] or None}
        return body, True

    return bool(patch_as_read(kube, "v1", "Node", name, decide, what=f"node {name}"))
