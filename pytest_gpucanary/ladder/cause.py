"""What a stall is said in: the `Cause` named for a node, the reasons, the times after which each stops
being something that clears by itself, and what the reading carries from one record to the next (a cause's
`Track`, the node's `Scene`). Shared by the reading (`ladder.stall`), the causes of each kind
(`ladder.operator_pods`, `ladder.eviction`) and the records the run adds for them (`ladder.diagnosis`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

# the operator's pods not yet bound to a node, recorded apart (kind Pod is what is on a node): a DaemonSet pod
# the scheduler cannot place has no nodeName, only the DaemonSet's affinity for its node; leaving that watch
# (DELETED) means bound or gone, so it ends that cause and no other
UNBOUND_POD = "UnboundPod"
# bound, but the kubelet has not made the pod's sandbox (PodReadyToStartContainers False): a volume it cannot
# mount (FailedMount), a runtime or network that refuses it (FailedCreatePodSandBox); a slow pull comes after
SANDBOX_NOT_READY = "SandboxNotReady"


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
class Track:
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
class Scene:
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


def one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text or "").split())[:limit]
