"""Why a pool node's upgrade is stuck, from the records alone, and whether it will clear by itself.

The operator's pods on the node (DaemonSet pods: the driver, its init containers, the operands) and
the Node itself are read in order of receipt. A cause is what the kubelet or the node says now; it is
terminal once it has outlasted what recovers on its own: a pull that failed PULL_ATTEMPTS times
across the kubelet's back-offs or for PULL_STUCK_S without a break (or an image name that can never pull), a container or init container
in CrashLoopBackOff after CRASH_RESTARTS restarts, a pod unschedulable or a node NotReady for
STUCK_S. A slow pull that then succeeds, or one restart and then Ready, never becomes terminal: the
cause clears when the container runs.

The run stops waiting at the first terminal cause; the rollout rung judges the same records, so
`gpucanary evaluate` names the same cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.ladder.timeline import SKIP_TYPES, Record

# container waiting reasons that mean the image did not come (kubelet: images.ErrImagePull and friends)
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable",
                 "SignatureValidationFailed")
NEVER_PULLS = ("InvalidImageName", "ErrImageNeverPull")
PULL_ATTEMPTS = 3        # ErrImagePull, back-off, ErrImagePull, back-off, ErrImagePull: about 30 s
PULL_STUCK_S = 60        # or failing this long without a break (a status that shows only the back-offs)
CRASH_RESTARTS = 3       # the kubelet's back-off is 10, 20, 40 s: about 70 s of crash loop
STUCK_S = 180            # unschedulable, or the node NotReady, this long


LOG_KIND = "ContainerLog"  # a record the run adds: the tail of a crash-looping container's last run
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class Cause:
    node: str
    what: str                  # "driver pod gpu-operator/nvidia-driver-daemonset-x, container nvidia-driver-ctr"
    reason: str                # ImagePullBackOff, CrashLoopBackOff, Unschedulable, NotReady
    message: str
    since_wall_ns: int         # first seen
    terminal_wall_ns: int | None = None   # when it stopped being something that clears by itself
    namespace: str = ""        # the pod and container, for a container's cause ("" for a node's)
    pod: str = ""
    container: str = ""

    def line(self, offset_s: float | None = None) -> str:
        since = f" since +{offset_s:.0f} s" if offset_s is not None else ""
        return f"{self.what} on {self.node}: {self.reason}{since}: {self.message}" if self.message else \
            f"{self.what} on {self.node}: {self.reason}{since}"


@dataclass
class _Track:
    reason: str = ""
    since_wall_ns: int = 0
    attempts: int = 0          # pull failures entered (a back-off in between counts the next one)
    terminal_wall_ns: int | None = None


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text or "").split())[:limit]


def causes(records: Iterable[Record], node: str, *, since_wall_ns: int) -> list[Cause]:
    """What holds the node's upgrade up now, each with when it became terminal (None: may still clear)."""
    tracks: dict[tuple[str, str], _Track] = {}
    current: dict[tuple[str, str], Cause] = {}
    for record in records:
        if record.type in SKIP_TYPES or record.received_wall_ns < since_wall_ns:
            continue
        at = record.received_wall_ns
        if record.kind == "Node" and record.name == node:
            _node(record, at, tracks, current)
        elif record.kind == "Pod" and (record.object.get("spec") or {}).get("nodeName") == node:
            _pod(record, at, node, tracks, current)
    return sorted(current.values(), key=lambda c: c.since_wall_ns)


def terminal(records: Iterable[Record], nodes: Iterable[str], *, since_wall_ns: int) -> Cause | None:
    """The first cause on any of the nodes that will not clear by itself, if there is one."""
    found = [c for n in nodes for c in causes(records, n, since_wall_ns=since_wall_ns) if c.terminal_wall_ns]
    return min(found, key=lambda c: c.terminal_wall_ns or 0) if found else None


def _node(record: Record, at: int, tracks: dict, current: dict) -> None:
    node = record.name or ""
    key = ("Node", node)
    ready = next((c for c in (record.object.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                 None)
    if record.type == "DELETED" or ready is None or ready.get("status") == "True":
        tracks.pop(key, None)
        current.pop(key, None)
        return
    track = tracks.setdefault(key, _Track("NotReady", at))
    if track.terminal_wall_ns is None and at - track.since_wall_ns >= STUCK_S * 1e9:
        track.terminal_wall_ns = at
    current[key] = Cause(node, f"node {node}", "NotReady", _one_line(f"{ready.get('reason', '')}: "
                                                                      f"{ready.get('message', '')}".strip(": ")),
                         track.since_wall_ns, track.terminal_wall_ns)


def _pod(record: Record, at: int, node: str, tracks: dict, current: dict) -> None:
    pod = record.object
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    uid = meta.get("uid", "")
    if not any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or []):
        return                                   # the canary's own and tenants' pods are other rungs' business
    who = (f"{'driver' if op.is_driver_pod(meta.get('labels') or {}) else 'operator'} pod "
           f"{meta.get('namespace', '')}/{meta.get('name', '')}")
    if record.type == "DELETED" or meta.get("deletionTimestamp"):
        for key in [k for k in tracks if k[0] == uid]:
            tracks.pop(key)
            current.pop(key, None)
        return
    scheduled = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
    key = (uid, "")
    if scheduled is not None and scheduled.get("status") == "False":
        track = tracks.setdefault(key, _Track(scheduled.get("reason", "Unschedulable"), at))
        if track.terminal_wall_ns is None and at - track.since_wall_ns >= STUCK_S * 1e9:
            track.terminal_wall_ns = at
        current[key] = Cause(node, who, track.reason, _one_line(scheduled.get("message")), track.since_wall_ns,
                             track.terminal_wall_ns)
    else:
        tracks.pop(key, None)
        current.pop(key, None)
    for init, statuses in ((True, status.get("initContainerStatuses")), (False, status.get("containerStatuses"))):
        for container in statuses or []:
            _container(container, init, at, node, who, meta, tracks, current)


def _container(container: dict, init: bool, at: int, node: str, who: str, pod_meta: dict, tracks: dict,
               current: dict) -> None:
    name = container.get("name", "")
    uid, namespace, pod = pod_meta.get("uid", ""), pod_meta.get("namespace", ""), pod_meta.get("name", "")
    key = (uid, name)
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason", "")
    what = f"{who}, {'init container' if init else 'container'} {name}"
    if reason in PULL_FAILURES:
        track = tracks.get(key) or _Track(reason, at)
        if reason != track.reason or track.attempts == 0:
            track.attempts += reason != "ImagePullBackOff"
        track.reason = reason
        tracks[key] = track
        if track.terminal_wall_ns is None and (reason in NEVER_PULLS or track.attempts >= PULL_ATTEMPTS
                                               or at - track.since_wall_ns >= PULL_STUCK_S * 1e9):
            track.terminal_wall_ns = at
        image = container.get("image", "")
        message = _one_line(waiting.get("message")) or f"image {image}"
        if image and image not in message:
            message = f"image {image}: {message}"
        current[key] = Cause(node, what, reason, f"{message} ({track.attempts} pull attempts)", track.since_wall_ns,
                             track.terminal_wall_ns, namespace, pod, name)
        return
    restarts = int(container.get("restartCount") or 0)
    if reason == "CrashLoopBackOff":
        track = tracks.get(key) or _Track(reason, at)
        track.reason = reason
        tracks[key] = track
        if track.terminal_wall_ns is None and restarts >= CRASH_RESTARTS:
            track.terminal_wall_ns = at
        last = (container.get("lastState") or {}).get("terminated") or {}
        said = _one_line(last.get("message"))
        message = f"exit code {last.get('exitCode', '?')}" + (f" ({last['reason']})" if last.get("reason") else "")
        current[key] = Cause(node, what, reason, f"{message} after {restarts} restarts" + (f": {said}" if said else ""),
                             track.since_wall_ns, track.terminal_wall_ns, namespace, pod, name)
        return
    tracks.pop(key, None)                        # running, terminated or creating: whatever it was has cleared
    current.pop(key, None)


def log_record(cause: Cause, text: str, *, mono_ns: int, wall_ns: int) -> Record:
    """The record the run adds for a crash loop's log, so the rung (and a replay) can quote it."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()][-LOG_TAIL_LINES:]
    return Record("diagnosis", "ADDED", LOG_KIND, cause.namespace, cause.pod, mono_ns, wall_ns,
                  {"container": cause.container, "lines": lines})


def log_tail(records: Iterable[Record], cause: Cause) -> list[str]:
    """The last log lines the run read for the cause's container, if it read them."""
    found = [r for r in records if r.kind == LOG_KIND and r.namespace == cause.namespace and r.name == cause.pod
             and r.object.get("container") == cause.container]
    return list(found[-1].object.get("lines") or []) if found else []


def last_meaningful(lines: list[str]) -> str:
    """The last line that says something: not blank, not a shell's trace or a bare separator."""
    for line in reversed(lines):
        text = " ".join(line.split())
        if text and not text.startswith("+ ") and any(c.isalnum() for c in text):
            return text[:300]
    return ""
