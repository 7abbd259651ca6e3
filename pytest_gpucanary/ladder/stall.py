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
`gpucanary evaluate` names the same cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.ladder.timeline import SKIP_TYPES, Record
from pytest_gpucanary.safe_text import one_line, without_secrets

# container waiting reasons that mean the image did not come (kubelet: images.ErrImagePull and friends)
PULL_FAILURES = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
    "SignatureValidationFailed",
)
NEVER_PULLS = ("InvalidImageName", "ErrImageNeverPull")
PULL_ATTEMPTS = 3  # ErrImagePull, back-off, ErrImagePull, back-off, ErrImagePull: about 30 s
PULL_STUCK_S = 60  # or failing this long without a break (a status that shows only the back-offs)
CRASH_RESTARTS = 3  # the kubelet's back-off is 10, 20, 40 s: about 70 s of crash loop
STUCK_S = 180  # unschedulable, the node NotReady, an operand blocked behind a Ready driver this long
# (the default of the stall_s knob)
EVICTION_REFUSED = "EvictionRefused"
OPERAND_BLOCKED = "BlockedInInit"
READY_DRIVER = "the driver pod is Ready"  # what an operand waits behind once its wait counts
NOT_STARTED = "NotStarted"  # running, its startup probe not yet passed
# the upgrade state in which the operator evicts, the policy knob it reads, and whether only GPU pods go
EVICTING = {op.POD_DELETION_REQUIRED: ("podDeletion", True), op.DRAIN_REQUIRED: ("drain", False)}


LOG_KIND = "ContainerLog"  # a record the run adds: a container's log tail, when it has changed
# the operator's pods not yet bound to a node, recorded apart (kind Pod is what is on a node): a DaemonSet pod
# the scheduler cannot place has no nodeName, only the DaemonSet's affinity for its node; leaving that watch
# (DELETED) means bound or gone, so it ends that cause and no other
UNBOUND_POD = "UnboundPod"
# bound, but the kubelet has not made the pod's sandbox (PodReadyToStartContainers False): a volume it cannot
# mount (FailedMount), a runtime or network that refuses it (FailedCreatePodSandBox); a slow pull comes after
SANDBOX_NOT_READY = "SandboxNotReady"
# the kubelet's Warnings that say why a sandbox does not come (others, such as MissingClusterDNS, come with
# every pod on some nodes and say nothing of it)
SANDBOX_WARNINGS = ("FailedCreatePodSandBox", "FailedMount", "FailedAttachVolume", "NetworkNotReady")
WARNING_KIND = "PodWarning"  # a record the run adds: the newest Warning event of a pod whose sandbox does not come
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class Cause:
    node: str
    what: str  # "driver pod gpu-operator/nvidia-driver-daemonset-x, container nvidia-driver-ctr"
    reason: str  # ImagePullBackOff, CrashLoopBackOff, Unschedulable, NotReady
    message: str
    since_wall_ns: int  # first seen
    terminal_wall_ns: int | None = None  # when it stopped being something that clears by itself
    namespace: str = ""  # the pod and container, for a container's cause ("" for a node's)
    pod: str = ""
    container: str = ""

    def line(self, offset_s: float | None = None) -> str:
        since = f" since +{offset_s:.0f} s" if offset_s is not None else ""
        return (
            f"{self.what} on {self.node}: {self.reason}{since}: {self.message}"
            if self.message
            else f"{self.what} on {self.node}: {self.reason}{since}"
        )


@dataclass
class _Track:
    reason: str = ""
    since_wall_ns: int = 0
    attempts: int = 0  # pull failures entered (a back-off in between counts the next one)
    terminal_wall_ns: int | None = None

    limit_s: float | None = None  # terminal this long after since (or after from_wall_ns, if later)
    from_wall_ns: int = 0
    detail: str = ""  # an operand's wait, without what it waits behind

    def outlasted(self, at: int, limit_s: float | None, *, from_wall_ns: int = 0) -> None:
        """Terminal once the cause has held `limit_s`: at that moment, not at the next record's."""
        self.limit_s, self.from_wall_ns = limit_s, from_wall_ns
        if self.terminal_wall_ns is None and (deadline := self.deadline()) is not None and at >= deadline:
            self.terminal_wall_ns = deadline

    def deadline(self) -> int | None:
        if self.limit_s is None:
            return None
        return max(self.since_wall_ns, self.from_wall_ns) + int(self.limit_s * 1e9)


@dataclass
class _Scene:
    """What the causes that span objects read: the node's upgrade state, the budgets, the pods there."""

    stuck_s: float = STUCK_S  # how long a state that could clear by itself may last
    state: str = ""
    driver_ready_wall_ns: int | None = None
    budgets: dict[str, dict[str, dict]] = field(default_factory=dict)  # namespace -> name -> budget
    pods: dict[str, dict] = field(default_factory=dict)  # uid -> the latest pod not of a DaemonSet
    holders: dict[str, str] = field(default_factory=dict)  # uid -> "ns/name (why it holds the driver)"
    uids: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, name) -> uid, pods on the node
    said_since: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (ns, pod, container) -> last log change
    warnings: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, pod) -> its newest Warning event


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text or "").split())[:limit]


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
    `stuck_s` is that time for the states without a count of their own (STUCK_S above)."""
    tracks: dict[tuple[str, str], _Track] = {}
    current: dict[tuple[str, str], Cause] = {}
    scene = _Scene(stuck_s=stuck_s)
    for record in records:
        if record.type in SKIP_TYPES:
            continue
        at = record.received_wall_ns
        if record.kind == "PodDisruptionBudget":
            if not _budget(record, scene):
                continue
        elif record.kind == "Node" and record.name == node:
            scene.state = ((record.object.get("metadata") or {}).get("labels") or {}).get(op.UPGRADE_STATE_LABEL, "")
            if at >= since_wall_ns:
                _node(record, at, scene.stuck_s, tracks, current)
        elif record.kind == "Pod" and (record.object.get("spec") or {}).get("nodeName") == node:
            _scene_pod(record, at, scene)
            if at >= since_wall_ns:
                _pod(record, at, node, scene, tracks, current)
        elif record.kind == UNBOUND_POD and (record.object.get("spec") or {}).get("daemonSetNode") == node:
            if at >= since_wall_ns:
                _unbound(record, at, node, scene, tracks, current)
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
            _refused(at, node, scene, policy or {}, tracks, current)
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
    scene = _Scene()
    for record in records:
        if (
            record.kind == "Pod"
            and record.type not in SKIP_TYPES
            and (record.object.get("spec") or {}).get("nodeName") == node
        ):
            _scene_pod(record, record.received_wall_ns, scene)
    return list(scene.holders.values())


def _budget(record: Record, scene: _Scene) -> bool:
    """Keep the budget; True when a pod on the node could be one it guards (a cluster has many budgets)."""
    namespace, name = record.namespace or "", record.name or ""
    if record.type == "DELETED":
        scene.budgets.get(namespace, {}).pop(name, None)
    else:
        scene.budgets.setdefault(namespace, {})[name] = record.object
    return any((p.get("metadata") or {}).get("namespace") == namespace for p in scene.pods.values())


def _scene_pod(record: Record, at: int, scene: _Scene) -> None:
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


def _refused(at: int, node: str, scene: _Scene, policy: Mapping[str, Any], tracks: dict, current: dict) -> None:
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
        track = tracks.setdefault(key, _Track(EVICTION_REFUSED, at))
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
    track = tracks.setdefault(key, _Track("NotReady", at))
    track.outlasted(at, stuck_s)
    current[key] = Cause(
        node,
        f"node {node}",
        "NotReady",
        _one_line(f"{ready.get('reason', '')}: {ready.get('message', '')}".strip(": ")),
        track.since_wall_ns,
        track.terminal_wall_ns,
    )


def _pod(record: Record, at: int, node: str, scene: _Scene, tracks: dict, current: dict) -> None:
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
    scene: _Scene,
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
    track = tracks.setdefault(key, _Track(SANDBOX_NOT_READY, at))
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


def warning_record(cause: Cause, event: Mapping[str, Any], *, mono_ns: int, wall_ns: int) -> Record:
    """The record the run adds for the newest Warning event of a pod whose sandbox does not come."""
    text = without_secrets(one_line(f"{event.get('reason', '')}: {event.get('message', '')}"))[:300]
    return Record("diagnosis", "ADDED", WARNING_KIND, cause.namespace, cause.pod, mono_ns, wall_ns, {"text": text})


def last_warning(records: Iterable[Record], cause: Cause) -> str:
    """The Warning the run last read for the cause's pod, if it read one."""
    found = [r for r in records if r.kind == WARNING_KIND and r.namespace == cause.namespace and r.name == cause.pod]
    return found[-1].object.get("text", "") if found else ""


def _who(meta: Mapping[str, Any]) -> str:
    kind = "driver" if op.is_driver_pod(meta.get("labels") or {}) else "operator"
    return f"{kind} pod {meta.get('namespace', '')}/{meta.get('name', '')}"


def _unbound(record: Record, at: int, node: str, scene: _Scene, tracks: dict, current: dict) -> None:
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
    track = tracks.setdefault(key, _Track(scheduled.get("reason", "Unschedulable"), at))
    track.outlasted(at, scene.stuck_s)
    current[key] = Cause(
        node,
        _who(meta),
        track.reason,
        _one_line(scheduled.get("message")),
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
    scene: _Scene,
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
    track = tracks.setdefault(key, _Track(OPERAND_BLOCKED, at))
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


def _behind(track: _Track, at: int, scene: _Scene) -> str:
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
    scene: _Scene,
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
        track = tracks.get(key) or _Track(reason, at)
        if reason != track.reason or track.attempts == 0:
            track.attempts += reason != "ImagePullBackOff"
        track.reason = reason
        tracks[key] = track
        if track.terminal_wall_ns is None and (reason in NEVER_PULLS or track.attempts >= PULL_ATTEMPTS):
            track.terminal_wall_ns = at
        track.outlasted(at, PULL_STUCK_S)
        image = container.get("image", "")
        message = _one_line(waiting.get("message")) or f"image {image}"
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
        track = track or _Track("CrashLoopBackOff", at)
        track.reason = "CrashLoopBackOff"
        tracks[key] = track
        if track.terminal_wall_ns is None and restarts >= CRASH_RESTARTS:
            track.terminal_wall_ns = at
        state = container.get("state") or {}
        last = state.get("terminated") or (container.get("lastState") or {}).get("terminated") or {}
        said = _one_line(last.get("message"))
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
            track = tracks[key] = _Track(NOT_STARTED, at)
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


def _said(record: Record, at: int, scene: _Scene, tracks: dict) -> None:
    """A log the run read: a container that has not started is quiet only from its last change (so it
    cannot turn terminal here: its time starts again now)."""
    namespace, pod, container = record.namespace or "", record.name or "", record.object.get("container", "")
    scene.said_since[(namespace, pod, container)] = at
    track = tracks.get((scene.uids[(namespace, pod)], container))
    if track is not None and track.reason == NOT_STARTED and track.terminal_wall_ns is None:
        track.outlasted(at, scene.stuck_s, from_wall_ns=at)


def log_record(cause: Cause, text: str, *, mono_ns: int, wall_ns: int) -> Record:
    """The record the run adds for a container's log (a crash loop's last run, or one that has not started),
    so the rung (and a replay) can quote it and see when it last changed."""
    lines = [without_secrets(one_line(line)) for line in text.splitlines() if line.strip()][-LOG_TAIL_LINES:]
    return Record(
        "diagnosis",
        "ADDED",
        LOG_KIND,
        cause.namespace,
        cause.pod,
        mono_ns,
        wall_ns,
        {"container": cause.container, "lines": lines},
    )


def log_tail(records: Iterable[Record], cause: Cause) -> list[str]:
    """The last log lines the run read for the cause's container, if it read them."""
    found = [
        r
        for r in records
        if r.kind == LOG_KIND
        and r.namespace == cause.namespace
        and r.name == cause.pod
        and r.object.get("container") == cause.container
    ]
    return list(found[-1].object.get("lines") or []) if found else []


# lines that only announce the next try (NVIDIA's validator: "Attempting to validate a driver container
# installation", "failed to validate the driver, retrying after 5 seconds"): what failed is said before them
_RETRY_WORDS = ("retrying after", "attempting to ")


def last_meaningful(lines: list[str]) -> str:
    """The last line that says something: not blank, not a shell's trace or a bare separator, and not a
    retry's announcement while a line before it says more."""
    said = [
        text
        for text in (" ".join(line.split()) for line in lines)
        if text and not text.startswith("+ ") and any(c.isalnum() for c in text)
    ]
    more = [text for text in said if not any(words in text.lower() for words in _RETRY_WORDS)]
    return (more or said or [""])[-1][:300]
