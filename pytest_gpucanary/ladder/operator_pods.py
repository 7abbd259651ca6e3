"""Why an operator pod on the node (a DaemonSet pod: the driver, its init containers, the operands) is
not running, from its latest record: an image that does not pull, a crash loop, a startup probe not passed,
a sandbox the kubelet has not made, a pod the scheduler cannot place, an operand held in an init container
behind the driver. Each cause with when it stopped being something that clears by itself; `ladder.stall`
reads the records in order and hands each pod's here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.ladder.cause import (
    CRASH_RESTARTS,
    NEVER_PULLS,
    NOT_STARTED,
    OPERAND_BLOCKED,
    PULL_ATTEMPTS,
    PULL_FAILURES,
    PULL_STUCK_S,
    READY_DRIVER,
    SANDBOX_NOT_READY,
    Cause,
    Scene,
    Track,
    one_line,
)
from pytest_gpucanary.ladder.timeline import Record


def pod(record: Record, at: int, node: str, scene: Scene, tracks: dict, current: dict) -> None:
    pod = record.object
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    uid = meta.get("uid", "")
    if not op.of_daemonset(meta):
        return  # others' pods matter only when an eviction of them is refused
    driver = op.is_driver_pod(meta.get("labels") or {})
    who = _who(meta)
    if record.type == "DELETED" or meta.get("deletionTimestamp"):
        for key in [k for k in tracks if k[0] == uid]:
            tracks.pop(key)
            current.pop(key, None)
        return
    tracks.pop((uid, ""), None)  # bound: whatever kept it off the node has cleared
    current.pop((uid, ""), None)
    _sandbox(status, at, node, who, meta, scene, tracks, current)
    holders = ", ".join(scene.holders.values()) if driver else ""
    for init, statuses in ((True, status.get("initContainerStatuses")), (False, status.get("containerStatuses"))):
        for container in statuses or []:
            _container(container, init, at, node, who, meta, holders, scene, tracks, current)
    if not driver:
        _blocked(status, at, node, who, meta, scene, tracks, current)
        return
    for key in [k for k in tracks if k[1] == OPERAND_BLOCKED and k in current]:  # their time runs from now
        track = tracks[key]
        current[key] = replace(
            current[key],
            message=f"{track.detail} ({_behind(track, at, scene)})",
            terminal_wall_ns=track.terminal_wall_ns,
        )


def _sandbox(
    status: Mapping[str, Any],
    at: int,
    node: str,
    who: str,
    meta: Mapping[str, Any],
    scene: Scene,
    tracks: dict,
    current: dict,
) -> None:
    """A pod on the node whose sandbox the kubelet has not made: terminal once that has lasted the stall time."""
    key = (meta.get("uid", ""), SANDBOX_NOT_READY)
    waiting = next((c for c in status.get("conditions") or [] if c.get("type") == "PodReadyToStartContainers"), None)
    if status.get("phase") != "Pending" or waiting is None or waiting.get("status") != "False":
        tracks.pop(key, None)
        current.pop(key, None)
        return
    track = tracks.setdefault(key, Track(SANDBOX_NOT_READY, at))
    track.outlasted(at, scene.stuck_s)
    current[key] = Cause(
        node,
        who,
        SANDBOX_NOT_READY,
        "its sandbox is not made (PodReadyToStartContainers False): a "
        "volume not mounted, or a runtime or network that refuses it",
        track.since_wall_ns,
        track.terminal_wall_ns,
        meta.get("namespace", ""),
        meta.get("name", ""),
    )


def _who(meta: Mapping[str, Any]) -> str:
    kind = "driver" if op.is_driver_pod(meta.get("labels") or {}) else "operator"
    return f"{kind} pod {meta.get('namespace', '')}/{meta.get('name', '')}"


def unbound(record: Record, at: int, node: str, scene: Scene, tracks: dict, current: dict) -> None:
    """An operator pod made for the node that the scheduler cannot place there (PodScheduled False)."""
    pod = record.object
    meta = pod.get("metadata") or {}
    if not op.of_daemonset(meta):
        return
    key = (meta.get("uid", ""), "")
    if record.type == "DELETED" or meta.get("deletionTimestamp") or (scheduled := op.unplaced(pod)) is None:
        tracks.pop(key, None)
        current.pop(key, None)
        return
    track = tracks.setdefault(key, Track(scheduled.get("reason", "Unschedulable"), at))
    track.outlasted(at, scene.stuck_s)
    current[key] = Cause(
        node,
        _who(meta),
        track.reason,
        one_line(scheduled.get("message")),
        track.since_wall_ns,
        track.terminal_wall_ns,
        meta.get("namespace", ""),
        meta.get("name", ""),
    )


def _blocked(
    status: Mapping[str, Any],
    at: int,
    node: str,
    who: str,
    meta: Mapping[str, Any],
    scene: Scene,
    tracks: dict,
    current: dict,
) -> None:
    """An operand held in an init container that runs (waits), e.g. the validator's wait for the driver."""
    inits = status.get("initContainerStatuses") or []
    holding = next((c for c in inits if "running" in (c.get("state") or {})), None)
    key = (meta.get("uid", ""), OPERAND_BLOCKED)
    if holding is None or status.get("phase") != "Pending":
        tracks.pop(key, None)
        current.pop(key, None)
        return
    done = sum(1 for c in inits if ((c.get("state") or {}).get("terminated") or {}).get("exitCode") == 0)
    track = tracks.setdefault(key, Track(OPERAND_BLOCKED, at))
    track.detail = f"Init:{done}/{len(inits)}, in init container {holding.get('name', '')}"
    driver = _behind(track, at, scene)
    current[key] = Cause(
        node,
        who,
        OPERAND_BLOCKED,
        f"{track.detail} ({driver})",
        track.since_wall_ns,
        track.terminal_wall_ns,
        meta.get("namespace", ""),
        meta.get("name", ""),
        holding.get("name", ""),
    )


def _behind(track: Track, at: int, scene: Scene) -> str:
    """An operand's wait counts only once the driver pod is Ready (before that the driver is the one to watch),
    and again from each time it turns Ready; what it waits behind, in words."""
    ready = scene.driver_ready_wall_ns
    track.outlasted(at, scene.stuck_s if ready is not None else None, from_wall_ns=ready or 0)
    return READY_DRIVER if ready is not None else "the driver is not ready"


def _container(
    container: dict,
    init: bool,
    at: int,
    node: str,
    who: str,
    pod_meta: dict,
    holders: str,
    scene: Scene,
    tracks: dict,
    current: dict,
) -> None:
    name = container.get("name", "")
    uid, namespace, pod = pod_meta.get("uid", ""), pod_meta.get("namespace", ""), pod_meta.get("name", "")
    key = (uid, name)
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason", "")
    what = f"{who}, {'init container' if init else 'container'} {name}"
    if reason in PULL_FAILURES:
        track = tracks.get(key) or Track(reason, at)
        if reason != track.reason or track.attempts == 0:
            track.attempts += reason != "ImagePullBackOff"
        track.reason = reason
        tracks[key] = track
        if track.terminal_wall_ns is None and (reason in NEVER_PULLS or track.attempts >= PULL_ATTEMPTS):
            track.terminal_wall_ns = at
        track.outlasted(at, PULL_STUCK_S)
        image = container.get("image", "")
        message = one_line(waiting.get("message")) or f"image {image}"
        if image and image not in message:
            message = f"image {image}: {message}"
        current[key] = Cause(
            node,
            what,
            reason,
            f"{message} ({track.attempts} pull attempts)",
            track.since_wall_ns,
            track.terminal_wall_ns,
            namespace,
            pod,
            name,
        )
        return
    restarts = int(container.get("restartCount") or 0)
    track = tracks.get(key)
    # the kubelet shows CrashLoopBackOff only between a crash and the next try: the loop goes on while the
    # container runs or has just exited again, until it is ready
    looping = track is not None and track.reason == "CrashLoopBackOff" and not container.get("ready")
    if reason == "CrashLoopBackOff" or looping:
        track = track or Track("CrashLoopBackOff", at)
        track.reason = "CrashLoopBackOff"
        tracks[key] = track
        if track.terminal_wall_ns is None and restarts >= CRASH_RESTARTS:
            track.terminal_wall_ns = at
        state = container.get("state") or {}
        last = state.get("terminated") or (container.get("lastState") or {}).get("terminated") or {}
        said = one_line(last.get("message"))
        message = f"exit code {last.get('exitCode', '?')}" + (f" ({last['reason']})" if last.get("reason") else "")
        held = f"; pods on the node hold the driver without a GPU request: {holders}" if holders else ""
        current[key] = Cause(
            node,
            what,
            "CrashLoopBackOff",
            f"{message} after {restarts} restarts" + (f": {said}" if said else "") + held,
            track.since_wall_ns,
            track.terminal_wall_ns,
            namespace,
            pod,
            name,
        )
        return
    if "running" in (container.get("state") or {}) and container.get("started") is False:
        track = tracks.get(key)
        if track is None or track.reason != NOT_STARTED:
            track = tracks[key] = Track(NOT_STARTED, at)
        track.outlasted(at, scene.stuck_s, from_wall_ns=scene.said_since.get((namespace, pod, name), 0))
        current[key] = Cause(
            node,
            what,
            NOT_STARTED,
            "running, its startup probe has not passed",
            track.since_wall_ns,
            track.terminal_wall_ns,
            namespace,
            pod,
            name,
        )
        return
    tracks.pop(key, None)  # running and ready, or creating: whatever it was has cleared
    current.pop(key, None)
