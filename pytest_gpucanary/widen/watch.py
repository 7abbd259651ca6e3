"""What a wave is judged on, read from the live cluster: every pod removed from the wave's nodes (a watch
of all pods, from the wave's release to the end of its soak), and each node's upgrade state, readiness,
driver pod, validator pod and GPUs back in allocatable. `judge` is the rule; the rest reads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pytest_gpucanary.canary.claims import ClaimedGpus
from pytest_gpucanary.config import Settings
from pytest_gpucanary.gpu_operator import (
    DRIVER_COMPONENT_SELECTOR,
    GPU_RESOURCE,
    UPGRADE_DONE,
    UPGRADE_FAILED,
    UPGRADE_STATE_LABEL,
    VALIDATOR_SELECTOR,
    driver_version_of,
    gpus_requested,
    of_daemonset,
)
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.ladder.application import allows_eviction
from pytest_gpucanary.ladder.timeline import Record
from pytest_gpucanary.widen.slo import SloLook
from pytest_gpucanary.widen.state import Disruption

UNSEEN_LOOKS = 3


@dataclass(frozen=True)
class NodeSeen:
    state: str
    ready: bool
    driver: str  # the version its driver pod runs; "" when it has none
    driver_ready: bool
    validated: bool = True  # the operator's validator pod on the node is Ready
    gpus: int = 0  # nvidia.com/gpu allocatable
    gpus_before: int = 0  # nvidia.com/gpu capacity: what allocatable must be back to

    def trouble(self, target: str) -> str:
        """What keeps the node from counting as upgraded and serving ("" when nothing does)."""
        if self.state != UPGRADE_DONE:
            return self.state or "no upgrade state"
        if not self.ready:
            return "NotReady"
        if self.driver != target or not self.driver_ready:
            return f"driver {self.driver or 'none'}" + ("" if self.driver_ready else " not ready")
        if not self.validated:
            return "validator not ready"
        if self.gpus < self.gpus_before:
            return f"{self.gpus}/{self.gpus_before} GPUs allocatable"
        return ""


class PodWatch:
    """Records, once per pod, every pod not of a DaemonSet that leaves one of the watched nodes: deleted (pod
    deletion, a drain's eviction, anyone's delete) or evicted by the kubelet. DaemonSet pods are the
    operator's own operands, which it restarts by design and which neither pod deletion nor drain touches."""

    def __init__(self, kube: Kube, settings: Settings) -> None:
        self.kube, self.settings = kube, settings
        self._nodes: frozenset[str] = frozenset()
        self._known: dict[str, dict] = {}  # uid -> a pod not of a DaemonSet, as last seen
        self._seen_gone: set[str] = set()
        self._found: list[Disruption] = []
        self._claimed = ClaimedGpus(kube)  # GPUs a pod holds through DRA claims, read while they are allocated
        self._probe_namespace = ""
        self._probe_records: list[Record] = []  # every event of a pod in the start probes' namespace
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error = ""
        self._thread = threading.Thread(target=self._run, name="gpucanary-widen-pods", daemon=True)

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=70)

    def watch_nodes(self, nodes: list[str]) -> None:
        with self._lock:
            self._nodes = frozenset(nodes)

    def watch_probes(self, namespace: str) -> None:
        with self._lock:
            self._probe_namespace = namespace

    def probe_records(self, since_wall_ns: int) -> list[Record]:
        """The start probes' pod events received since `since_wall_ns`; older ones are dropped."""
        with self._lock:
            self._probe_records = [r for r in self._probe_records if r.received_wall_ns >= since_wall_ns]
            return list(self._probe_records)

    def take(self) -> list[Disruption]:
        """The disruptions found since the last call."""
        with self._lock:
            found, self._found = self._found, []
        return found

    def unseen(self) -> str:
        """Why pods are not being watched now ("" while they are)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            return self.error or "the pod watch stopped"
        return self.error

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in self.kube.watch("v1", "Pod", stop=self._stop):
                    with self._lock:
                        self._see(event.type, event.object, event.received_wall_ns, event.received_mono_ns)
                        self.error = ""
            except Exception as err:  # noqa: BLE001 - a watch that cannot read is judged (`unseen`), never silent
                self.error = f"pods cannot be watched: {err}"[:300]
                self._stop.wait(2)

    def _see(self, kind: str, obj: dict, wall_ns: int, mono_ns: int = 0) -> None:
        if kind == "RELISTED":  # what vanished while the watch was down was deleted
            present = {p["metadata"]["uid"] for p in obj["items"]}
            for uid, pod in list(self._known.items()):
                if uid not in present:
                    self._gone(pod, "deleted", wall_ns)
            for pod in obj["items"]:
                self._see("ADDED", pod, wall_ns, mono_ns)
            return
        meta = obj["metadata"]
        if self._probe_namespace and meta.get("namespace") == self._probe_namespace:
            self._probe_records.append(
                Record("pods", kind, "Pod", meta["namespace"], meta.get("name"), mono_ns, wall_ns, obj)
            )
        if of_daemonset(meta):
            return
        if kind == "DELETED" or meta.get("deletionTimestamp"):
            self._gone(obj, "deleted", wall_ns)
        elif (obj.get("status") or {}).get("reason") == "Evicted":
            self._gone(obj, "evicted by the kubelet", wall_ns)
        else:
            self._known[meta["uid"]] = obj
            if (obj.get("spec") or {}).get("nodeName") in self._nodes:
                self._claimed(obj)  # read now: a claim goes away with its pod

    def _gone(self, pod: dict, how: str, wall_ns: int) -> None:
        """Every pod is known (a wave's nodes change), and counted only when it leaves a watched node: once, where
        its leaving is first seen. A pod already going when its node's wave began (a drain before the sweep, an
        earlier sweep's eviction still in its grace period) is not that wave's doing."""
        meta, spec = pod["metadata"], pod.get("spec") or {}
        self._known.pop(meta["uid"], None)
        first = meta["uid"] not in self._seen_gone
        self._seen_gone.add(meta["uid"])
        if (
            not first or spec.get("nodeName") not in self._nodes or meta.get("namespace") == self._probe_namespace
        ):  # the sweep's own probes are no customer's
            return
        gpus = gpus_requested(spec.get("containers") or []) + self._claimed(pod)
        allowed = allows_eviction(self.settings, gpus=gpus, labels=meta.get("labels") or {})
        self._found.append(
            Disruption(spec.get("nodeName", ""), meta.get("namespace", ""), meta["name"], gpus, allowed, wall_ns, how)
        )


def operand_pods(kube: Kube, selector: str, namespace: str | None) -> list[dict]:
    """The operator's pods of one kind (`selector`) that are not going."""
    return [
        pod
        for pod in kube.list("v1", "Pod", label_selector=selector, namespace=namespace)
        if not pod["metadata"].get("deletionTimestamp")
    ]


def nodes_seen(
    kube: Kube, nodes: list[str], namespace: str | None, driver_pods: list[dict] | None = None
) -> dict[str, NodeSeen]:
    """Each node's upgrade state, readiness and driver pod (from `driver_pods` when the caller read them); a node
    gone is not in the answer."""

    def by_node(pods: list[dict]) -> dict[str, dict]:
        return {pod["spec"]["nodeName"]: pod for pod in pods if (pod.get("spec") or {}).get("nodeName") in nodes}

    if driver_pods is None:
        driver_pods = operand_pods(kube, DRIVER_COMPONENT_SELECTOR, namespace)
    drivers, validators = by_node(driver_pods), by_node(operand_pods(kube, VALIDATOR_SELECTOR, namespace))
    seen = {}
    for name in nodes:
        try:
            node = kube.get("v1", "Node", name)
        except NotFound:
            continue
        pod, status = drivers.get(name), node.get("status") or {}
        seen[name] = NodeSeen(
            (node["metadata"].get("labels") or {}).get(UPGRADE_STATE_LABEL, ""),
            _ready(node),
            driver_version_of(pod) if pod else "",
            pod is not None and _ready(pod),
            name in validators and _ready(validators[name]),
            _count(status.get("allocatable"), GPU_RESOURCE),
            _count(status.get("capacity"), GPU_RESOURCE),
        )
    return seen


def _count(resources: dict | None, name: str) -> int:
    try:
        return int((resources or {}).get(name, 0))
    except ValueError:
        return 0


def _ready(obj: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def judge(
    nodes: list[str], seen: dict[str, NodeSeen], disruptions: list[Disruption], *, target: str, soaking: bool
) -> tuple[bool, str]:
    """(every node upgraded and healthy, why the wave failed or ""). Rolling, a node may pass through any state;
    soaking, it must stay upgrade-done, Ready, on the target driver."""
    for d in disruptions:
        if not d.allowed:
            return False, f"{d.line()}, not an allowed eviction"
    for node in nodes:
        now = seen.get(node)
        if now is None:
            return False, f"node {node} was deleted during its wave"
        if now.state == UPGRADE_FAILED:
            return False, f"node {node} went {UPGRADE_FAILED} (driver pod at {now.driver or 'none'})"
    trouble = {n: seen[n].trouble(target) for n in nodes}
    if soaking:
        for node, what in trouble.items():
            if what:
                return False, f"node {node} stopped serving on driver {target} during the soak: {what}"
    return not any(trouble.values()), ""


def left_hold(driver_pods: list[dict], held: Sequence[str], target: str) -> str:
    """Why a node held for a later wave is no longer held ("" while each is): its driver pod runs the target. The
    skip label holds the operator's upgrade, not the DaemonSet: a held node's driver pod that anyone deletes
    comes back from the template, which has been the target's since the change was applied."""
    for pod in sorted(driver_pods, key=lambda p: p["metadata"]["name"]):
        node = (pod.get("spec") or {}).get("nodeName")
        if node in held and driver_version_of(pod) == target:
            return (
                f"node {node}, held for a later wave, runs driver {target} outside its wave: its driver pod "
                f"{pod['metadata']['name']} came back from the new template (deleted while held?)"
            )
    return ""


def wait_and_judge(
    kube: Kube,
    pods: PodWatch,
    slos: SloLook,
    nodes: list[str],
    namespace: str | None,
    *,
    target: str,
    seconds: float,
    soaking: bool,
    record: Callable[[dict[str, NodeSeen], list[Disruption]], None],
    customers: Callable[[], str],
    held: Sequence[str] = (),
    tick_s: float = 2.0,
) -> str:
    """Judge the wave every tick for up to `seconds`, `customers` saying why its start probes fail it and
    `held` naming the nodes that must stay on their old driver meanwhile. Rolling: returns "" once every node is
    upgraded, the failure when one shows, "timeout" at the end. Soaking: "" at the end unless a failure shows
    first."""
    deadline, unseen = time.monotonic() + seconds, 0
    while True:
        drivers = operand_pods(kube, DRIVER_COMPONENT_SELECTOR, namespace)  # one read for both questions
        seen = nodes_seen(kube, nodes, namespace, drivers)
        found = pods.take()
        record(seen, found)
        done, failure = judge(nodes, seen, found, target=target, soaking=soaking)
        unseen = unseen + 1 if (why := pods.unseen()) else 0
        if not failure and unseen >= UNSEEN_LOOKS:  # a removal it cannot see is not a pass
            failure = f"{why} ({UNSEEN_LOOKS} looks in a row)"
        failure = failure or left_hold(drivers, held, target) or slos.failure() or customers()
        if failure:
            return failure
        if done and not soaking:
            return ""
        if time.monotonic() >= deadline:
            return "" if soaking else "timeout"
        time.sleep(min(tick_s, max(0.0, deadline - time.monotonic())))
