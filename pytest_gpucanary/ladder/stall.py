"""Why a pool node's upgrade is stuck, from the records alone, and whether it will clear by itself.

The operator's pods on the node (DaemonSet pods: the driver, its init containers, the operands) and
the Node itself are read in order of receipt. A cause is what the kubelet or the node says now; it is
terminal once it has outlasted what recovers on its own: a pull that failed PULL_ATTEMPTS times
across the kubelet's back-offs or for PULL_STUCK_S without a break (or an image name that can never pull),
a container or init container in CrashLoopBackOff after CRASH_RESTARTS restarts, a pod unschedulable (an
operator pod made for the node that the scheduler cannot place: recorded apart, as UNBOUND_POD) or a node
NotReady for STUCK_S, or a pod bound there whose sandbox the kubelet has not made that long (a volume it
cannot mount, a runtime or network that refuses it: quoted from the pod's Warning event, which the run
reads). A slow pull that then succeeds, or one restart and then Ready, never becomes terminal: the
cause clears when the container runs. A container that runs but has not passed its startup probe (a
driver container that hangs in `nvidia-driver init`) is terminal once it has been quiet for STUCK_S:
its log (the run reads it while the cause lasts and keeps each change) has said nothing new in that
time, so a module build that still prints keeps its time.

Two causes come from more than one object. An eviction refused by a PodDisruptionBudget: while the
node is in pod-deletion-required (GPU pods) or drain-required (every pod not of a DaemonSet), a pod
still there that a budget with no disruption allowed selects. The operator's drain helper retries it
every 5 s until the knob's timeoutSeconds, then fails the node; with timeoutSeconds 0 it retries
forever, so it is terminal at the knob's timeout, or after STUCK_S when there is none. Operands
blocked behind the driver: an operand pod held in an init container (the validator's and the
device plugin's wait for the driver); terminal STUCK_S after the node's driver pod became Ready,
since only then is the operand itself the cause. A driver pod's crash loop names the pods on the node
that hold the driver without asking for a GPU (`gpu_operator.holds_driver`): the driver manager cannot
unload a driver they hold; pod deletion leaves them (they request no GPU), and a drain runs only when
pod deletion fails and never evicts DaemonSet pods.

The run stops waiting at the first terminal cause; the rollout rung judges the same records, so
`gpucanary evaluate` names the same cause. Each kind of cause is found in `ladder.operator_pods` or
`ladder.eviction`; the `Cause` and the times are in `ladder.cause`, the records the run adds for the causes
in `ladder.diagnosis`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.ladder import eviction, operator_pods
from pytest_gpucanary.ladder.cause import (
    NOT_STARTED,
    OPERAND_BLOCKED,
    SANDBOX_NOT_READY,
    STUCK_S,
    UNBOUND_POD,
    Cause,
    Scene,
    Track,
    one_line,
)
from pytest_gpucanary.ladder.diagnosis import LOG_KIND, WARNING_KIND
from pytest_gpucanary.ladder.timeline import SKIP_TYPES, Record


def causes(
    records: Iterable[Record],
    node: str,
    *,
    since_wall_ns: int,
    policy: Mapping[str, Any] | None = None,
    now_wall_ns: int | None = None,
    stuck_s: float = STUCK_S,
) -> list[Cause]:
    """What holds the node's upgrade up now, each with when it became terminal (None: may still clear).
    `policy` is the upgradePolicy applied: its pod deletion and drain timeouts bound a refused eviction.
    `now_wall_ns` (the watch's present, or a recording's end) ends the causes that have held their time;
    `stuck_s` is that time for the states without a count of their own (STUCK_S, in `ladder.cause`)."""
    tracks: dict[tuple[str, str], Track] = {}
    current: dict[tuple[str, str], Cause] = {}
    scene = Scene(stuck_s=stuck_s)
    for record in records:
        if record.type in SKIP_TYPES:
            continue
        at = record.received_wall_ns
        if record.kind == "PodDisruptionBudget":
            if not eviction.budget(record, scene):
                continue
        elif record.kind == "Node" and record.name == node:
            scene.state = ((record.object.get("metadata") or {}).get("labels") or {}).get(op.UPGRADE_STATE_LABEL, "")
            if at >= since_wall_ns:
                _node(record, at, scene.stuck_s, tracks, current)
        elif record.kind == "Pod" and (record.object.get("spec") or {}).get("nodeName") == node:
            _scene_pod(record, at, scene)
            if at >= since_wall_ns:
                operator_pods.pod(record, at, node, scene, tracks, current)
        elif record.kind == UNBOUND_POD and (record.object.get("spec") or {}).get("daemonSetNode") == node:
            if at >= since_wall_ns:
                operator_pods.unbound(record, at, node, scene, tracks, current)
            continue
        elif record.kind == LOG_KIND and (record.namespace or "", record.name or "") in scene.uids:
            _said(record, at, scene, tracks)
            continue
        elif record.kind == WARNING_KIND:
            scene.warnings[(record.namespace or "", record.name or "")] = record.object.get("text", "")
            continue
        else:
            continue
        if at >= since_wall_ns:
            eviction.refused(at, node, scene, policy or {}, tracks, current)
    for key, track in tracks.items() if now_wall_ns is not None else ():
        if (
            key in current
            and track.terminal_wall_ns is None
            and (deadline := track.deadline()) is not None
            and now_wall_ns is not None
            and now_wall_ns >= deadline
        ):
            track.terminal_wall_ns = deadline
            current[key] = replace(current[key], terminal_wall_ns=deadline)
    for key, cause in current.items():  # the kubelet's own words, once the run has read them
        if cause.reason == SANDBOX_NOT_READY and (said := scene.warnings.get((cause.namespace, cause.pod))):
            current[key] = replace(cause, message=said)
    return sorted(current.values(), key=lambda c: c.since_wall_ns)


def terminal(
    records: Iterable[Record],
    nodes: Iterable[str],
    *,
    since_wall_ns: int,
    policy: Mapping[str, Any] | None = None,
    now_wall_ns: int | None = None,
    stuck_s: float = STUCK_S,
) -> Cause | None:
    """The first cause on any of the nodes that will not clear by itself, if there is one."""
    return first_terminal(
        c
        for n in nodes
        for c in causes(
            records, n, since_wall_ns=since_wall_ns, policy=policy, now_wall_ns=now_wall_ns, stuck_s=stuck_s
        )
    )


# NVIDIA's operands wait on each other in this order, each in an init container named for what it waits on
# (the toolkit and validator on the driver, the device plugin on the toolkit, ...)
VALIDATION_CHAIN = ("driver-validation", "toolkit-validation", "cuda-validation", "plugin-validation")


def first_terminal(found: Iterable[Cause]) -> Cause | None:
    """The cause to name: the first to turn terminal; of those that turned at once (operands blocked behind
    one Ready driver), a cause of the node or its driver pod, then the operand the others wait on."""

    def rank(cause: Cause) -> int:
        if cause.reason != OPERAND_BLOCKED:
            return 0
        return 1 + (
            VALIDATION_CHAIN.index(cause.container) if cause.container in VALIDATION_CHAIN else len(VALIDATION_CHAIN)
        )

    done = [c for c in found if c.terminal_wall_ns]
    return min(done, key=lambda c: (c.terminal_wall_ns or 0, rank(c))) if done else None


def holders(records: Iterable[Record], node: str) -> list[str]:
    """The pods running on the node now that hold the driver without a GPU request: "ns/name (why)"."""
    scene = Scene()
    for record in records:
        if (
            record.kind == "Pod"
            and record.type not in SKIP_TYPES
            and (record.object.get("spec") or {}).get("nodeName") == node
        ):
            _scene_pod(record, record.received_wall_ns, scene)
    return list(scene.holders.values())


def _scene_pod(record: Record, at: int, scene: Scene) -> None:
    pod = record.object
    meta = pod.get("metadata") or {}
    gone = record.type == "DELETED" or meta.get("deletionTimestamp")
    scene.uids[(meta.get("namespace", ""), meta.get("name", ""))] = meta.get("uid", "")
    why = (pod.get("spec") or {}).get("holdsDriver")
    if (
        why
        and not gone
        and (pod.get("status") or {}).get("phase") == "Running"
        and (meta.get("labels") or {}).get("app") not in op.OPERAND_APPS
    ):
        scene.holders[meta.get("uid", "")] = f"{meta.get('namespace', '')}/{meta.get('name', '')} ({why})"
    else:
        scene.holders.pop(meta.get("uid", ""), None)
    if op.of_daemonset(meta):
        if op.is_driver_pod(meta.get("labels") or {}):
            ready = not gone and _ready(pod)
            if not ready:
                scene.driver_ready_wall_ns = None
            elif scene.driver_ready_wall_ns is None:
                scene.driver_ready_wall_ns = at
    elif gone or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        scene.pods.pop(meta.get("uid", ""), None)
    else:
        scene.pods[meta.get("uid", "")] = pod


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _node(record: Record, at: int, stuck_s: float, tracks: dict, current: dict) -> None:
    node = record.name or ""
    key = ("Node", node)
    ready = next(
        (c for c in (record.object.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None
    )
    if record.type == "DELETED" or ready is None or ready.get("status") == "True":
        tracks.pop(key, None)
        current.pop(key, None)
        return
    track = tracks.setdefault(key, Track("NotReady", at))
    track.outlasted(at, stuck_s)
    current[key] = Cause(
        node,
        f"node {node}",
        "NotReady",
        one_line(f"{ready.get('reason', '')}: {ready.get('message', '')}".strip(": ")),
        track.since_wall_ns,
        track.terminal_wall_ns,
    )


def _said(record: Record, at: int, scene: Scene, tracks: dict) -> None:
    """A log the run read: a container that has not started is quiet only from its last change (so it
    cannot turn terminal here: its time starts again now)."""
    namespace, pod, container = record.namespace or "", record.name or "", record.object.get("container", "")
    scene.said_since[(namespace, pod, container)] = at
    track = tracks.get((scene.uids[(namespace, pod)], container))
    if track is not None and track.reason == NOT_STARTED and track.terminal_wall_ns is None:
        track.outlasted(at, scene.stuck_s, from_wall_ns=at)
