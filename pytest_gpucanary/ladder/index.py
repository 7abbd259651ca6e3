"""The recorded timeline read once: `TimelineIndex` keeps the records in order and, as each is added, files it
where the ladder's questions look (a node's records, the pods on a node, a pod's records by uid, the records
of a kind, what the stall reading of a node reads) and folds what a wait asks again and again (each pod's
latest state, each node's upgrade-state transitions, each Job's completion, the probe Jobs' pod times).

The answers are those of the queries in `ladder.timeline`, `ladder.jobs` and `ladder.stall` over the whole
timeline: each runs the same query over only the records it would not skip, or reads the fold that query
makes. The evidence builds one per run (`RunEvidence.index`); the recorder feeds one record by record, so a
wait reads a lookup, not the timeline. Pure, like the queries it answers for.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import Any, overload

from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder import jobs, timeline
from pytest_gpucanary.ladder.cause import UNBOUND_POD
from pytest_gpucanary.ladder.diagnosis import LOG_KIND, WARNING_KIND
from pytest_gpucanary.ladder.model import PhaseWindow, ProbeSeen, StateSpan
from pytest_gpucanary.ladder.timeline import SKIP_TYPES, PodGone, PodSeen, Record, Transition

_NODE_SKIP = SKIP_TYPES + ("DELETED",)
_STALL_KINDS = ("PodDisruptionBudget", LOG_KIND, WARNING_KIND)  # read by every node's stall reading


class TimelineIndex:
    """The records in order (a sequence of `Record`s, as the queries take), filed and folded as they come."""

    def __init__(self, records: tuple[Record, ...] | list[Record] = ()) -> None:
        self.records: list[Record] = []
        self._span: tuple[int, int] | None = None
        self._kinds: dict[str, list[Record]] = {}
        self._nodes: dict[str, list[Record]] = {}  # Node records by name, but deletions and markers
        self._node_events: dict[str, list[Record]] = {}  # Event records about a Node, by its name
        self._pods_on: dict[str, list[Record]] = {}  # Pod records by spec.nodeName
        self._pod_at: dict[str, list[int]] = {}  # a pod's records by uid: positions in `records`
        self._uids_on: dict[str, dict[str, None]] = {}  # uids ever recorded on a node
        self._uids_in: dict[str, dict[str, None]] = {}  # uids ever recorded in a namespace
        self._job_pods: dict[tuple[str, str], list[Record]] = {}  # Pod records by (namespace, job-name label)
        self._stall_at: dict[str, list[int]] = {}  # what the stall reading of a node reads, but for _STALL_KINDS
        self._stall_common: list[int] = []
        self._pods: dict[str, PodSeen] = {}  # every pod's latest state, in the order first seen
        self._first: dict[str, int] = {}  # the order each pod was first seen in
        self._upgrade: dict[str, list[Transition]] = {}
        self._jobs: dict[tuple[str | None, str | None], jobs.JobSeen] = {}
        self._probes: dict[str | None, dict[str, dict[str, Any]]] = {}  # namespace -> job-name -> pod times
        self._memo: dict[tuple, Any] = {}
        for record in records:
            self.add(record)

    # --- a sequence of records ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    @overload
    def __getitem__(self, at: int) -> Record: ...
    @overload
    def __getitem__(self, at: slice) -> list[Record]: ...
    def __getitem__(self, at: int | slice) -> Record | list[Record]:
        return self.records[at]

    # --- filing ------------------------------------------------------------------------------------------

    def add(self, record: Record) -> None:
        at, position = record.received_wall_ns, len(self.records)
        self.records.append(record)
        if self._memo:
            self._memo.clear()
        self._span = (min(self._span[0], at), max(self._span[1], at)) if self._span else (at, at)
        self._kinds.setdefault(record.kind, []).append(record)
        if record.kind == "Pod":
            self._probe(record)
        if record.type in SKIP_TYPES:
            return
        obj = record.object
        if record.kind in _STALL_KINDS:
            self._stall_common.append(position)
        elif record.kind == "Node":
            self._stall_at.setdefault(record.name or "", []).append(position)
            if record.type != "DELETED":
                self._node(record)
        elif record.kind == "Event" and record.type != "DELETED":
            involved = obj.get("involvedObject") or {}
            if involved.get("kind") == "Node":
                self._node_events.setdefault(involved.get("name") or "", []).append(record)
        elif record.kind == "Pod":
            self._pod(record, position)
        elif record.kind == UNBOUND_POD:
            node = (obj.get("spec") or {}).get("daemonSetNode")
            self._stall_at.setdefault(node or "", []).append(position)
        elif record.kind == "Job":
            key = (record.namespace, record.name)
            self._jobs[key] = jobs.job_seen(record, self._jobs.get(key))

    def _node(self, record: Record) -> None:
        name = record.name or ""
        self._nodes.setdefault(name, []).append(record)
        state = (record.object.get("metadata", {}).get("labels") or {}).get(UPGRADE_STATE_LABEL, "")
        transitions = self._upgrade.setdefault(name, [])
        if not transitions or transitions[-1].state != state:
            transitions.append(Transition(name, state, record.received_wall_ns))

    def _pod(self, record: Record, position: int) -> None:
        meta, spec = record.object.get("metadata") or {}, record.object.get("spec") or {}
        uid = meta.get("uid", "")
        if uid not in self._pods:
            self._first[uid] = len(self._first)
        self._pods[uid] = timeline.pod_seen(record, self._pods.get(uid))
        self._pod_at.setdefault(uid, []).append(position)
        self._uids_in.setdefault(meta.get("namespace", ""), {})[uid] = None
        node = spec.get("nodeName")
        if node is not None:
            self._pods_on.setdefault(node, []).append(record)
            self._uids_on.setdefault(node, {})[uid] = None
            self._stall_at.setdefault(node, []).append(position)
        job = (meta.get("labels") or {}).get("job-name")
        if job is not None:
            self._job_pods.setdefault((record.namespace or "", job), []).append(record)

    def _probe(self, record: Record) -> None:
        job = (record.object.get("metadata", {}).get("labels") or {}).get("job-name")
        if job is not None:
            jobs.probe_step(self._probes.setdefault(record.namespace, {}), job, record)

    # --- what the queries over the whole timeline answer -------------------------------------------------

    def span(self) -> tuple[int, int] | None:
        """`timeline.recording_span`."""
        return self._span

    def of_kind(self, kind: str) -> list[Record]:
        return self._kinds.get(kind, [])

    def node_records(self, node: str) -> list[Record]:
        """The node's records (neither deletions nor a relist's or a watch error's markers), as recorded."""
        return self._nodes.get(node, [])

    def label_transitions(self, node: str, label: str = UPGRADE_STATE_LABEL) -> list[Transition]:
        if label == UPGRADE_STATE_LABEL:
            return list(self._upgrade.get(node, []))
        return timeline.label_transitions(self.node_records(node), node, label)

    def upgrade_states(self, node: str) -> list[str]:
        return [t.state for t in self._upgrade.get(node, [])]

    def terminal_state(self, node: str, *, since_state: str = timeline.UPGRADE_REQUIRED) -> str | None:
        return timeline.terminal_of(self.upgrade_states(node), since_state)

    def upgrade_cycle(self, node: str, *, since_wall_ns: int) -> list[Transition]:
        return list(self._memoised(("cycle", node, since_wall_ns), lambda: self._cycle(node, since_wall_ns)))

    def _cycle(self, node: str, since_wall_ns: int) -> list[Transition]:
        return timeline.cycle_of(self._upgrade.get(node, []), since_wall_ns)

    def phase_windows(self, node: str, *, since_wall_ns: int) -> list[PhaseWindow]:
        return timeline.windows_of(self._span, self.upgrade_cycle(node, since_wall_ns=since_wall_ns))

    def state_spans(self, node: str) -> list[StateSpan]:
        return timeline.spans_of(node, self._upgrade.get(node, []), self._span)

    def node_events(self, node: str, *, reason: str = timeline.UPGRADE_EVENT_REASON) -> list[timeline.EventSeen]:
        return timeline.node_events(self._node_events.get(node, []), node, reason=reason)

    def latest_node(self, node: str, *, until_wall_ns: int | None = None) -> timeline.NodeSeen | None:
        return timeline.latest_node(self.node_records(node), node, until_wall_ns=until_wall_ns)

    def allocatable_series(self, node: str, resource: str) -> list[tuple[int, int | None]]:
        return timeline.allocatable_series(self.node_records(node), node, resource)

    def pod_records_on(self, node: str) -> list[Record]:
        """The Pod records that name `node` as theirs (but a relist's and a watch error's markers)."""
        return self._pods_on.get(node, [])

    def pods_gone(self, node: str) -> list[PodGone]:
        return list(self._memoised(("gone", node), lambda: timeline.pods_gone(self.pod_records_on(node), node)))

    def latest_pods(self, *, until_wall_ns: int | None = None, ever_on: str | None = None) -> list[PodSeen]:
        """`timeline.latest_pods`; with `ever_on`, only the pods ever recorded on that node (a superset of those
        whose latest state is there)."""
        if ever_on is None:
            if until_wall_ns is None:
                return list(self._pods.values())
            return timeline.latest_pods(self.records, until_wall_ns=until_wall_ns)
        positions = heapq.merge(*(self._pod_at[uid] for uid in self._uids_on.get(ever_on, {})))
        return timeline.latest_pods([self.records[i] for i in positions], until_wall_ns=until_wall_ns)

    def pods_on(self, node: str) -> list[PodSeen]:
        """The pods whose latest state is on the node, in the order first seen."""
        by_node: dict[str | None, list[PodSeen]] = self._memoised(("by node",), self._by_node)
        return list(by_node.get(node, []))

    def _by_node(self) -> dict[str | None, list[PodSeen]]:
        by_node: dict[str | None, list[PodSeen]] = {}
        for p in self._pods.values():
            by_node.setdefault(p.node, []).append(p)
        return by_node

    def pods_in(self, namespace: str) -> list[PodSeen]:
        """The pods whose latest state is in the namespace, in the order first seen: looked up, not searched for."""
        uids = sorted(self._uids_in.get(namespace, {}), key=self._first.__getitem__)
        return [p for uid in uids if (p := self._pods[uid]).namespace == namespace]

    def live_pods(
        self, *, node: str | None = None, namespace: str | None = None, label: tuple[str, str] | None = None
    ) -> list[PodSeen]:
        """`timeline.live_pods`."""
        if namespace is not None:
            pods = self.pods_in(namespace)
        else:
            pods = self.pods_on(node) if node is not None else list(self._pods.values())
        return [
            p
            for p in pods
            if p.removed_wall_ns is None
            and (node is None or p.node == node)
            and (label is None or p.labels.get(label[0]) == label[1])
        ]

    def latest_job(self, *, namespace: str, name: str) -> jobs.JobSeen | None:
        return self._jobs.get((namespace, name))

    def run_seconds(self, *, namespace: str, job_name: str) -> float:
        end_ns = self._span[1] if self._span else 0
        return jobs.seconds_run(self._job_pods.get((namespace, job_name), []), end_ns, namespace, job_name)

    def probes_seen(self, created: Mapping[str, tuple[str, int]], *, namespace: str) -> list[ProbeSeen]:
        return jobs.probes_of(self._probes.get(namespace, {}), created)

    def stall_records(self, node: str) -> list[Record]:
        """What `ladder.stall` reads for the node, in order: the node, the pods on it and the operator's pods made
        for it, the budgets, the logs and Warnings the run read."""
        positions = heapq.merge(self._stall_common, self._stall_at.get(node, []))
        return [self.records[i] for i in positions]

    def _memoised(self, key: tuple, compute: Any) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]
