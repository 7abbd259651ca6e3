"""What other systems did to the pool's nodes while the run recorded them, read from the timeline: a cordon,
an uncordon or a taint by a writer that is neither the upgrade nor the canary, and a NodeMaintenance for one
of them beginning or ending. Pure, like the timeline's other queries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pytest_gpucanary.ladder.timeline import SKIP_TYPES, Record

# What the upgrade itself writes to a node's schedulability (its drain helper cordons and uncordons), as the apiserver
# names the writer (the field manager, from the client's user agent); the canary's own taints are under its domain,
# and Kubernetes' own (a cordon's node.kubernetes.io/unschedulable, NotReady's) are not another system's act.
UPGRADE_WRITERS = ("gpu-operator", "k8s-driver-manager", "gpucanary")
CANARY_TAINT_DOMAIN, KUBERNETES_TAINT_DOMAIN = "gpucanary.io/", "node.kubernetes.io/"
NODE_MAINTENANCE_KIND = "NodeMaintenance"


@dataclass(frozen=True)
class NeighbourAct:
    """Something another system did to a pool node during the run: a cordon, a taint, a NodeMaintenance."""

    node: str
    wall_ns: int
    what: str  # "cordoned", "tainted nvsentinel/quarantine=true:NoSchedule", "NodeMaintenance ns/name began", ...
    by: str  # the field manager that wrote it, or the NodeMaintenance's requestor; "unknown" when not recorded
    # (the apiserver keeps no writer of a field that is gone: the untaint of a node's last taint)

    def line(self) -> str:
        return f"{self.node}: {self.what} by {self.by}"


def _node_marks(obj: dict) -> tuple[bool, set[tuple[str, str, str]]]:
    taints = {
        (t.get("key", ""), t.get("value", ""), t.get("effect", ""))
        for t in (obj.get("spec") or {}).get("taints") or []
        if not t.get("key", "").startswith((CANARY_TAINT_DOMAIN, KUBERNETES_TAINT_DOMAIN))
    }
    return bool((obj.get("spec") or {}).get("unschedulable")), taints


def neighbour_acts(records: Iterable[Record], nodes: Iterable[str]) -> list[NeighbourAct]:
    """Cordons, uncordons and taints that a writer other than the upgrade and the canary put on the pool's nodes
    while the run recorded them (the first record of a node is where it stood), and each NodeMaintenance for one
    of them beginning or ending, in the order seen."""
    nodes, acts = set(nodes), []
    last: dict[str, tuple[bool, set[tuple[str, str, str]]]] = {}
    for record in records:
        if record.type in SKIP_TYPES:
            continue
        if record.kind == NODE_MAINTENANCE_KIND and record.type in ("ADDED", "DELETED"):
            spec = record.object.get("spec") or {}
            if spec.get("nodeName") in nodes:
                acts.append(
                    NeighbourAct(
                        spec["nodeName"],
                        record.received_wall_ns,
                        f"NodeMaintenance {record.namespace}/{record.name} "
                        f"{'began' if record.type == 'ADDED' else 'ended'}",
                        spec.get("requestorID") or "unknown",
                    )
                )
            continue
        if record.kind != "Node" or record.name not in nodes or record.type == "DELETED":
            continue
        cordoned, taints = _node_marks(record.object)
        writers = (record.object.get("metadata") or {}).get("specWriters") or {}
        if record.name in last:
            was_cordoned, had = last[record.name]
            # a cordon whose writer is not recorded may be the upgrade's own: only a named writer counts
            changes = (
                [(f"{'cordoned' if cordoned else 'uncordoned'}", writers["unschedulable"])]
                if cordoned != was_cordoned and "unschedulable" in writers
                else []
            )
            changes += [(f"tainted {k}={v}:{e}", writers.get("taints")) for k, v, e in sorted(taints - had)]
            changes += [(f"untainted {k}={v}:{e}", writers.get("taints")) for k, v, e in sorted(had - taints)]
            acts += [
                NeighbourAct(record.name, record.received_wall_ns, what, by or "unknown")
                for what, by in changes
                if by not in UPGRADE_WRITERS
            ]
        last[record.name] = cordoned, taints
    return acts
