"""The recorded timeline: its `Record` (one JSONL line), and pure queries over it: upgrade-state
transitions, operator events, pod removals, the latest state of each pod and node. The Jobs' (probe times
included) are in `ladder.jobs`, other systems' acts on the nodes in `ladder.neighbours`.

Takes `Record`s, returns small frozen records; never talks to a cluster. Times are the client's
receive times (wall clock, ns) unless a field says it is the server's (RFC 3339, 1 s resolution).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pytest_gpucanary.gpu_operator import (
    TERMINAL_STATES,
    UPGRADE_EVENT_REASON,
    UPGRADE_REQUIRED,
    UPGRADE_STATE_LABEL,
    is_validator_pod,
)
from pytest_gpucanary.ladder.model import PHASE_OF_STATE, PhaseWindow, StateSpan, UpgradePhase


@dataclass(frozen=True)
class Record:
    stream: str
    type: str  # ADDED, MODIFIED, DELETED, LISTED (from a relist), RELISTED, WATCH_ERROR
    kind: str
    namespace: str | None
    name: str | None
    received_mono_ns: int  # client receive time, monotonic clock
    received_wall_ns: int  # client receive time, wall clock (Unix ns)
    object: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> Record:
        return cls(**json.loads(line))


def load(path: Path) -> list[Record]:
    """Read a timeline back; a torn last line (a crash mid-write) is skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(Record.from_json(line))
        except (ValueError, TypeError):
            continue
    return records


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
    server_time: str  # lastTimestamp or eventTime, apiserver clock, 1 s resolution
    received_wall_ns: int


@dataclass(frozen=True)
class PodGone:
    namespace: str
    name: str
    node: str
    gpus: int
    disruption_reason: str  # DisruptionTarget reason, e.g. EvictionByEvictionAPI; "" if none was seen
    received_wall_ns: int  # first sign of removal: deletionTimestamp set, or DELETED


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


def terminal_state(records: Iterable[Record], node: str, *, since_state: str = UPGRADE_REQUIRED) -> str | None:
    """upgrade-done or upgrade-failed, if the node reached one after it last entered `since_state`."""
    return terminal_of(upgrade_states(records, node), since_state)


def terminal_of(states: list[str], since_state: str = UPGRADE_REQUIRED) -> str | None:
    """`terminal_state` of the node's upgrade states, in order."""
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
        seen.setdefault(
            key,
            EventSeen(
                node=node,
                reason=reason,
                type=event.get("type", ""),
                message=event.get("message", ""),
                namespace=event["metadata"].get("namespace", ""),
                source=event.get("source", {}).get("component") or event.get("reportingComponent", ""),
                server_time=event.get("lastTimestamp") or event.get("eventTime") or "",
                received_wall_ns=record.received_wall_ns,
            ),
        )
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
            gone[uid] = PodGone(
                meta.get("namespace", ""),
                meta.get("name", ""),
                node,
                int(spec.get("gpus", 0)),
                "",
                record.received_wall_ns,
            )
    return [PodGone(**{**g.__dict__, "disruption_reason": reasons.get(uid, "")}) for uid, g in gone.items()]


SKIP_TYPES = ("RELISTED", "WATCH_ERROR")


@dataclass(frozen=True)
class PodSeen:
    """The last recorded state of one pod (by uid), with when it was first seen and first seen going away."""

    namespace: str
    name: str
    uid: str
    node: str | None
    phase: str
    labels: Mapping[str, str] = field(hash=False)
    owner_kinds: tuple[str, ...]
    gpus: int
    containers: int  # container statuses reported (regular containers only)
    ready_containers: int
    images: tuple[str, ...]  # from status.containerStatuses (the recorder trims pod specs)
    disruption_reason: str  # DisruptionTarget reason; "" if none was seen
    first_seen_wall_ns: int
    removed_wall_ns: int | None  # deletionTimestamp seen or DELETED, client receive time
    received_wall_ns: int  # the last record of this pod
    empty_dirs: tuple[str, ...] = ()  # names of emptyDir volumes (from the trimmed spec)
    ready_wall_ns: int | None = None  # first record Running with every container ready

    @property
    def ready(self) -> bool:
        return self.containers > 0 and self.ready_containers == self.containers


@dataclass(frozen=True)
class NodeSeen:
    name: str
    labels: Mapping[str, str] = field(hash=False)
    unschedulable: bool
    allocatable: Mapping[str, str] = field(hash=False)
    received_wall_ns: int


def recording_span(records: Iterable[Record]) -> tuple[int, int] | None:
    """First and last client receive time (wall ns) in the timeline; None when it is empty."""
    times = [r.received_wall_ns for r in records]
    return (min(times), max(times)) if times else None


def upgrade_cycle(records: Iterable[Record], node: str, *, since_wall_ns: int) -> list[Transition]:
    """The node's upgrade-state transitions from its first entry into upgrade-required at or after
    `since_wall_ns` (client receive time), or from the upgrade-required it was already in then; empty
    when it has not been upgrade-required since."""
    return cycle_of(label_transitions(records, node, UPGRADE_STATE_LABEL), since_wall_ns)


def cycle_of(every: list[Transition], since_wall_ns: int) -> list[Transition]:
    """`upgrade_cycle` of the node's every upgrade-state transition."""
    before = [t for t in every if t.received_wall_ns < since_wall_ns][-1:]
    transitions = before + [t for t in every if t.received_wall_ns >= since_wall_ns]
    starts = [i for i, t in enumerate(transitions) if t.state == UPGRADE_REQUIRED]
    return transitions[starts[0] :] if starts else []


def phase_windows(records: Iterable[Record], node: str, *, since_wall_ns: int) -> list[PhaseWindow]:
    """Consecutive upgrade phases of one node's cycle, from the start to the end of the recording."""
    records = list(records)
    return windows_of(recording_span(records), upgrade_cycle(records, node, since_wall_ns=since_wall_ns))


def windows_of(span: tuple[int, int] | None, cycle: list[Transition]) -> list[PhaseWindow]:
    """`phase_windows` of the recording's span and the node's upgrade cycle."""
    if span is None or not cycle:
        return []
    windows = [PhaseWindow(UpgradePhase.BEFORE, min(span[0], cycle[0].received_wall_ns), cycle[0].received_wall_ns)]
    for t in cycle:
        last = windows[-1]
        phase = PHASE_OF_STATE.get(t.state, last.phase)  # requestor-mode states: stay in the phase
        if phase is not last.phase:
            windows[-1] = PhaseWindow(last.phase, last.start_wall_ns, t.received_wall_ns)
            windows.append(PhaseWindow(phase, t.received_wall_ns, t.received_wall_ns))
    last = windows[-1]
    windows[-1] = PhaseWindow(last.phase, last.start_wall_ns, max(span[1], last.start_wall_ns))
    return [w for w in windows if w.end_wall_ns > w.start_wall_ns or w is windows[-1]]


def latest_node(records: Iterable[Record], node: str, *, until_wall_ns: int | None = None) -> NodeSeen | None:
    """The node as last recorded at or before `until_wall_ns` (the whole timeline when None)."""
    seen = None
    for record in records:
        if record.kind != "Node" or record.name != node or record.type in SKIP_TYPES + ("DELETED",):
            continue
        if until_wall_ns is not None and record.received_wall_ns > until_wall_ns:
            continue
        obj = record.object
        seen = NodeSeen(
            node,
            obj.get("metadata", {}).get("labels", {}) or {},
            bool(obj.get("spec", {}).get("unschedulable")),
            obj.get("status", {}).get("allocatable", {}) or {},
            record.received_wall_ns,
        )
    return seen


def latest_pods(records: Iterable[Record], *, until_wall_ns: int | None = None) -> list[PodSeen]:
    """Every pod recorded up to `until_wall_ns`, in its last recorded state, in the order first seen."""
    pods: dict[str, PodSeen] = {}
    for record in records:
        if record.kind != "Pod" or record.type in SKIP_TYPES:
            continue
        if until_wall_ns is not None and record.received_wall_ns > until_wall_ns:
            continue
        uid = record.object.get("metadata", {}).get("uid", "")
        pods[uid] = pod_seen(record, pods.get(uid))
    return list(pods.values())


def pod_seen(record: Record, before: PodSeen | None) -> PodSeen:
    pod = record.object
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {}) or {}
    statuses = status.get("containerStatuses", []) or []
    reason = next(
        (
            c.get("reason", "")
            for c in status.get("conditions", []) or []
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        "",
    )
    removed = record.received_wall_ns if record.type == "DELETED" or meta.get("deletionTimestamp") else None
    ready_now = (
        status.get("phase") == "Running"
        and bool(statuses)
        and all(c.get("ready") for c in statuses)
        and removed is None
    )
    return PodSeen(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        node=spec.get("nodeName") or (before.node if before else None),
        phase=status.get("phase", ""),
        labels=meta.get("labels", {}) or {},
        owner_kinds=tuple(o.get("kind", "") for o in meta.get("ownerReferences", []) or []),
        gpus=int(spec.get("gpus", 0) or 0),
        containers=len(statuses),
        ready_containers=sum(bool(c.get("ready")) for c in statuses),
        images=tuple(c.get("image", "") for c in statuses if c.get("image")),
        disruption_reason=reason or (before.disruption_reason if before else ""),
        first_seen_wall_ns=before.first_seen_wall_ns if before else record.received_wall_ns,
        removed_wall_ns=(before.removed_wall_ns if before and before.removed_wall_ns else removed),
        received_wall_ns=record.received_wall_ns,
        empty_dirs=tuple(spec.get("emptyDirs", []) or []),
        ready_wall_ns=(
            before.ready_wall_ns if before and before.ready_wall_ns else record.received_wall_ns if ready_now else None
        ),
    )


def allocatable_series(records: Iterable[Record], node: str, resource: str) -> list[tuple[int, int | None]]:
    """(receive time, allocatable count or None when not advertised) each time the node's value changed."""
    series: list[tuple[int, int | None]] = []
    for record in records:
        if record.kind != "Node" or record.name != node or record.type in SKIP_TYPES + ("DELETED",):
            continue
        raw = (record.object.get("status", {}).get("allocatable", {}) or {}).get(resource)
        value = int(raw) if raw is not None and str(raw).isdigit() else None
        if not series or series[-1][1] != value:
            series.append((record.received_wall_ns, value))
    return series


def state_spans(records: Iterable[Record], node: str) -> list[StateSpan]:
    """Each stretch of the node's upgrade-state label, the last one up to the end of the recording."""
    records = list(records)
    return spans_of(node, label_transitions(records, node, UPGRADE_STATE_LABEL), recording_span(records))


def spans_of(node: str, transitions: list[Transition], span: tuple[int, int] | None) -> list[StateSpan]:
    """`state_spans` of the node's upgrade-state transitions and the recording's span."""
    ends = [t.received_wall_ns for t in transitions[1:]] + [span[1] if span else 0]
    return [
        StateSpan(node, t.state, t.received_wall_ns, max(end, t.received_wall_ns)) for t, end in zip(transitions, ends)
    ]


def live_pods(
    records: Iterable[Record],
    *,
    node: str | None = None,
    namespace: str | None = None,
    label: tuple[str, str] | None = None,
) -> list[PodSeen]:
    """Pods in their last recorded state that were not seen going away, filtered as given."""
    return [
        p
        for p in latest_pods(records)
        if p.removed_wall_ns is None
        and (node is None or p.node == node)
        and (namespace is None or p.namespace == namespace)
        and (label is None or p.labels.get(label[0]) == label[1])
    ]


def validator_pods(records: Iterable[Record], nodes: Iterable[str]) -> list[PodSeen]:
    """The last state seen of each operator validator pod on the given nodes."""
    wanted = set(nodes)
    return [p for p in latest_pods(records) if p.node in wanted and is_validator_pod(p.labels)]
