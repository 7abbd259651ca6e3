"""Pure queries over a recorded timeline: upgrade-state transitions, operator events, pod removals.

Takes `Record`s, returns small frozen records; never talks to a cluster. Times are the client's
receive times (wall clock, ns) unless a field says it is the server's (RFC 3339, 1 s resolution).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pytest_gpucanary.recorder import Record

UPGRADE_STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
UPGRADE_EVENT_REASON = "GPUDriverUpgrade"
TERMINAL_STATES = ("upgrade-done", "upgrade-failed")


@dataclass(frozen=True)
class Transition:
    node: str
    state: str
    received_wall_ns: int


@dataclass(frozen=True)
class EventSeen:
    node: str
    reason: str
    type: str
    message: str
    namespace: str
    source: str
    server_time: str          # lastTimestamp or eventTime, apiserver clock, 1 s resolution
    received_wall_ns: int


@dataclass(frozen=True)
class PodGone:
    namespace: str
    name: str
    node: str
    gpus: int
    disruption_reason: str    # DisruptionTarget reason, e.g. EvictionByEvictionAPI; "" if none was seen
    received_wall_ns: int     # first sign of removal: deletionTimestamp set, or DELETED


def label_transitions(records: Iterable[Record], node: str, label: str) -> list[Transition]:
    transitions: list[Transition] = []
    for record in records:
        if record.kind != "Node" or record.name != node or record.type in ("RELISTED", "WATCH_ERROR", "DELETED"):
            continue
        value = record.object.get("metadata", {}).get("labels", {}).get(label, "")
        if not transitions or transitions[-1].state != value:
            transitions.append(Transition(node, value, record.received_wall_ns))
    return transitions


def upgrade_states(records: Iterable[Record], node: str) -> list[str]:
    return [t.state for t in label_transitions(records, node, UPGRADE_STATE_LABEL)]


def terminal_state(records: Iterable[Record], node: str, *, since_state: str = "upgrade-required") -> str | None:
    """upgrade-done or upgrade-failed, if the node reached one after it last entered `since_state`."""
    states = upgrade_states(records, node)
    if since_state not in states or states[-1] not in TERMINAL_STATES:
        return None
    last_since = len(states) - 1 - states[::-1].index(since_state)
    return states[-1] if last_since < len(states) - 1 else None


def node_events(records: Iterable[Record], node: str, *, reason: str = UPGRADE_EVENT_REASON) -> list[EventSeen]:
    seen: dict[tuple[str, int], EventSeen] = {}
    for record in records:
        if record.kind != "Event" or record.type in ("RELISTED", "WATCH_ERROR", "DELETED"):
            continue
        event = record.object
        involved = event.get("involvedObject", {})
        if involved.get("kind") != "Node" or involved.get("name") != node or event.get("reason") != reason:
            continue
        key = (event["metadata"].get("uid", ""), int(event.get("count") or 1))
        seen.setdefault(key, EventSeen(
            node=node, reason=reason, type=event.get("type", ""), message=event.get("message", ""),
            namespace=event["metadata"].get("namespace", ""),
            source=event.get("source", {}).get("component") or event.get("reportingComponent", ""),
            server_time=event.get("lastTimestamp") or event.get("eventTime") or "",
            received_wall_ns=record.received_wall_ns))
    return sorted(seen.values(), key=lambda e: e.received_wall_ns)


def pods_gone(records: Iterable[Record], node: str) -> list[PodGone]:
    """Pods on `node` that were deleted or evicted, once each, in the order first seen."""
    gone: dict[str, PodGone] = {}
    reasons: dict[str, str] = {}
    for record in records:
        if record.kind != "Pod" or record.type in ("RELISTED", "WATCH_ERROR"):
            continue
        pod = record.object
        meta, spec = pod.get("metadata", {}), pod.get("spec", {})
        if spec.get("nodeName") != node:
            continue
        uid = meta.get("uid", "")
        for condition in pod.get("status", {}).get("conditions", []) or []:
            if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
                reasons[uid] = condition.get("reason", "")
        if uid not in gone and (record.type == "DELETED" or meta.get("deletionTimestamp")):
            gone[uid] = PodGone(meta.get("namespace", ""), meta.get("name", ""), node, int(spec.get("gpus", 0)),
                                "", record.received_wall_ns)
    return [PodGone(**{**g.__dict__, "disruption_reason": reasons.get(uid, "")}) for uid, g in gone.items()]
