"""How the canary marks what it owns and what it carved: owner and run-id labels, the Pod Security of
its namespaces, the fence taint on a carved node and the toleration of the run's own pods, and the run a
saved annotation names.
"""

from __future__ import annotations

import json

OWNER_LABEL = "app.kubernetes.io/managed-by"
OWNER = "gpucanary"
RUN_ID_LABEL = "gpucanary.io/run-id"
POD_SECURITY_LABEL = "pod-security.kubernetes.io/enforce"
# A carved node's fence: NoSchedule for every pod but the run's own (and DaemonSets that tolerate the key)
FENCE_TAINT_KEY = "gpucanary.io/run"


def fence_taint(run_id: str) -> dict:
    return {"key": FENCE_TAINT_KEY, "value": run_id, "effect": "NoSchedule"}


def fence_toleration(run_id: str) -> dict:
    return {"key": FENCE_TAINT_KEY, "operator": "Equal", "value": run_id, "effect": "NoSchedule"}


def tolerated(taint: dict, tolerations: list[dict]) -> bool:
    """The scheduler's rule (k8s.io/api core/v1 Toleration.ToleratesTaint); PreferNoSchedule never keeps a pod off."""
    if taint.get("effect") == "PreferNoSchedule":
        return True
    for t in tolerations:
        key_ok = (
            t.get("key", "") in ("", taint.get("key"))
            if t.get("operator") == "Exists"
            else t.get("key") == taint.get("key")
        )
        value_ok = t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", "")
        if key_ok and value_ok and t.get("effect", "") in ("", taint.get("effect")):
            return True
    return False


def saved_run(obj: dict, annotation: str) -> str | None:
    """The run id a canary annotation on `obj` names (JSON with a run_id); `<unreadable ...>` (never a run id, so
    it matches no run) when it is not such JSON; None when `obj` carries no such annotation."""
    raw = (obj["metadata"].get("annotations") or {}).get(annotation)
    if raw is None:
        return None
    try:
        return str(json.loads(raw)["run_id"])
    except (ValueError, TypeError, KeyError):
        return f"<unreadable {str(raw)[:32]!r}>"


def owned_labels(run_id: str) -> dict[str, str]:
    return {OWNER_LABEL: OWNER, RUN_ID_LABEL: run_id}


def owned_namespace(name: str, run_id: str, *, pod_security: str = "baseline") -> dict:
    """A namespace of the run's, enforcing Pod Security `pod_security` on its pods (deploy/admission.yaml lets the
    canary's ServiceAccount create only gpucanary-* namespaces that carry the run id and enforce baseline or
    restricted)."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {**owned_labels(run_id), POD_SECURITY_LABEL: pod_security}},
    }
