"""An eviction a PodDisruptionBudget refuses: while the node is in the upgrade state in which the operator
evicts, a pod still there that a budget with no disruption allowed selects. The operator's drain helper
retries it until the policy knob's timeoutSeconds, so it is terminal then, or after the stall time when
there is none. The budgets are kept here as `ladder.stall` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.ladder.cause import EVICTION_REFUSED, Cause, Scene, Track
from pytest_gpucanary.ladder.timeline import Record

# the upgrade state in which the operator evicts, the policy knob it reads, and whether only GPU pods go
EVICTING = {op.POD_DELETION_REQUIRED: ("podDeletion", True), op.DRAIN_REQUIRED: ("drain", False)}


def budget(record: Record, scene: Scene) -> bool:
    """Keep the budget; True when a pod on the node could be one it guards (a cluster has many budgets)."""
    namespace, name = record.namespace or "", record.name or ""
    if record.type == "DELETED":
        scene.budgets.get(namespace, {}).pop(name, None)
    else:
        scene.budgets.setdefault(namespace, {})[name] = record.object
    return any((p.get("metadata") or {}).get("namespace") == namespace for p in scene.pods.values())


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector's match (an empty one selects every pod of a policy/v1 budget's namespace)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for term in selector.get("matchExpressions") or []:
        key, operator, values = term.get("key", ""), term.get("operator", ""), term.get("values") or []
        if (
            (operator == "In" and labels.get(key) not in values)
            or (operator == "NotIn" and labels.get(key) in values)
            or (operator == "Exists" and key not in labels)
            or (operator == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def refused(at: int, node: str, scene: Scene, policy: Mapping[str, Any], tracks: dict, current: dict) -> None:
    """Pods the operator must evict now that a budget with no disruption allowed selects."""
    knob, gpus_only = EVICTING.get(scene.state, ("", False))
    refused: dict[str, tuple[dict, tuple[str, str], dict]] = {}
    for uid, pod in scene.pods.items() if knob else ():
        meta = pod.get("metadata") or {}
        if gpus_only and not (pod.get("spec") or {}).get("gpus"):
            continue
        namespace = meta.get("namespace", "")
        for name, budget in scene.budgets.get(namespace, {}).items():
            status = budget.get("status") or {}
            if int(status.get("disruptionsAllowed", 1)) == 0 and selects(
                (budget.get("spec") or {}).get("selector"), meta.get("labels") or {}
            ):
                refused[uid] = (meta, (namespace, name), status)
                break
    for key in [k for k in tracks if k[1] == EVICTION_REFUSED and k[0] not in refused]:
        tracks.pop(key)
        current.pop(key, None)
    timeout_s = float(((policy.get(knob) or {}) if knob else {}).get("timeoutSeconds") or 0) or scene.stuck_s
    for uid, (meta, (namespace, name), status) in refused.items():
        key = (uid, EVICTION_REFUSED)
        track = tracks.setdefault(key, Track(EVICTION_REFUSED, at))
        track.outlasted(at, timeout_s)
        current[key] = Cause(
            node,
            f"pod {meta.get('namespace', '')}/{meta.get('name', '')}",
            EVICTION_REFUSED,
            f"{knob} cannot evict it: PodDisruptionBudget {namespace}/{name} allows 0 disruptions "
            f"({status.get('currentHealthy', '?')} healthy, {status.get('desiredHealthy', '?')} "
            f"required)",
            track.since_wall_ns,
            track.terminal_wall_ns,
            meta.get("namespace", ""),
            meta.get("name", ""),
        )
