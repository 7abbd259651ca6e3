"""The collective probe: an all-reduce between two pods on two nodes, once before the policy is applied
(baseline) and once the pool is back (after), so the network rung can hold the collective path across
the upgrade boundary against itself.

The pair is two pool nodes when the pool has them, else the pool node and a peer outside the pool on
the old driver (`--gpucanary-peer-node`, or the first Ready, schedulable GPU node with a free GPU;
`none` turns the peer probe off). Where the pool offers its GPUs through DRA, the ranks claim theirs as
the GPU job does (`claims`), and a peer's GPUs are the devices of its `gpu.nvidia.com` ResourceSlices.
Rank 0 is created first; rank 1 gets its pod IP as the master address. The figure is the
`# Avg bus bandwidth` line nccl-tests prints, read from rank 0's termination message or else its log.
A pod on a KWOK node runs no process: the fleet stands in for it, and the run says so ("simulated").
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary import claims, workloads
from pytest_gpucanary.canary.dra import RESOURCE_SLICE
from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import ConfigError, GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict, NotFound
from pytest_gpucanary.kube.ownership import OWNER_LABEL, RUN_ID_LABEL, tolerated
from pytest_gpucanary.ladder.model import CollectiveRun
from pytest_gpucanary.ladder.slices import GPU_DRIVER

BUSBW = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9]+(?:\.[0-9]+)?)", re.MULTILINE)
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"  # on every node KWOK manages ("fake")
PEER_OFF = "none"


def is_kwok_node(node: dict) -> bool:
    """KWOK manages the node (it runs no process); otherwise it is a real kubelet's."""
    return (node["metadata"].get("annotations") or {}).get(KWOK_NODE_ANNOTATION) == "fake"


def busbw_of(output: str) -> float | None:
    found = BUSBW.findall(output)
    return float(found[-1]) if found else None


def _allocatable_gpus(kube: Kube, node: dict, *, dra: bool) -> int:
    """The device plugin's GPUs, or with `dra` the devices the node's gpu.nvidia.com ResourceSlices offer."""
    if dra:
        name = node["metadata"]["name"]
        offered = kube.list(*RESOURCE_SLICE, field_selector=f"spec.nodeName={name},spec.driver={GPU_DRIVER}")
        return sum(len((s.get("spec") or {}).get("devices") or []) for s in offered)
    try:
        return int(node.get("status", {}).get("allocatable", {}).get(op.GPU_RESOURCE, "0"))
    except ValueError:
        return 0


def _ready(node: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in node.get("status", {}).get("conditions") or []
    )


def _driver(node: dict) -> str:
    return (node["metadata"].get("labels") or {}).get(op.DRIVER_VERSION_LABEL, "")


def _gpus_in_use(kube: Kube, node: str, claimed: claims.ClaimedGpus) -> int:
    used = 0
    for pod in kube.list("v1", "Pod", field_selector=f"spec.nodeName={node}"):
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for container in pod["spec"].get("containers") or []:
            limits = (container.get("resources") or {}).get("limits") or {}
            used += int(limits.get(op.GPU_RESOURCE, 0) or 0)
        used += claimed(pod)
    return used


def check_peer(kube: Kube, settings: Settings) -> None:
    """A named peer node exists and is not the pool's: read-only, before the run writes anything."""
    if settings.peer_node in (None, PEER_OFF):
        return
    if settings.peer_node == settings.pool_node:
        raise ConfigError(
            f"{flag('peer_node')}={settings.peer_node} is the pool node",
            hint="name a GPU node outside the pool, on the old driver",
        )
    try:
        kube.get("v1", "Node", settings.peer_node)
    except NotFound:
        raise ConfigError(
            f"{flag('peer_node')}={settings.peer_node}: no such node",
            hint=f"name a GPU node outside the pool, or {PEER_OFF}",
        ) from None


def choose_pair(kube: Kube, pool: Pool, settings: Settings, *, dra: bool = False) -> tuple[tuple[str, str] | None, str]:
    """The two nodes the probe runs on, or None and why not (the receipt's line). With `dra` (the pool offers its
    GPUs through DRA) a peer's free GPUs are its slices' devices less those its pods hold, claims included."""
    if len(pool.nodes) > 1:
        return (pool.nodes[0], pool.nodes[1]), ""
    if settings.peer_node == PEER_OFF:
        return None, f"collective probe off ({flag('peer_node')}={PEER_OFF})"
    if settings.peer_node:
        return (pool.nodes[0], settings.peer_node), ""
    if settings.kubeconfig:  # a production node takes a GPU (and the probe's image) only when named
        return None, (
            f"no peer node outside the pool on a real cluster unless named ({flag('peer_node')}=NODE): "
            "no collective probe"
        )
    probe = workloads.collective_pod(
        settings.collective_probe, workloads.Placement("", "", ""), when="check", rank=1, node="", master_addr=""
    )
    tolerations = probe["spec"].get("tolerations") or []
    claimed = claims.ClaimedGpus(kube)
    for node in sorted(kube.list("v1", "Node"), key=lambda n: n["metadata"]["name"]):
        name, labels, spec = node["metadata"]["name"], node["metadata"].get("labels") or {}, node.get("spec", {})
        if (
            name in pool.nodes
            or OWNER_LABEL in labels
            or RUN_ID_LABEL in labels
            or spec.get("unschedulable")
            or not _ready(node)
            or _driver(node) != pool.driver_from
            or not all(tolerated(t, tolerations) for t in spec.get("taints") or [])
        ):
            continue
        if _allocatable_gpus(kube, node, dra=dra) - _gpus_in_use(kube, name, claimed) >= 1:  # a pod list per node
            return (pool.nodes[0], name), ""
    return None, (
        f"no peer node for the collective probe: none Ready, schedulable, on driver {pool.driver_from} "
        f"with a free GPU and no taint the probe does not tolerate (name one with {flag('peer_node')})"
    )


@dataclass
class CollectiveProbe:
    """One probe run: `start` creates rank 0 and goes on in a thread (rank 1, both ranks' end, the
    figure), so the run's other work goes on meanwhile; `finish` waits for it and returns the result."""

    kube: Kube
    placement: workloads.Placement
    nodes: tuple[str, str]
    settings: Settings
    claim_gpus: bool = False  # the ranks claim their GPUs through DRA, from the run's templates
    when: str = ""
    started_wall_ns: int = 0
    drivers: tuple[str, ...] = ()
    how: str = ""  # "ran", or "simulated" when a node is KWOK's (it runs no process)
    _thread: threading.Thread | None = None
    _result: CollectiveRun | None = None

    def start(self, when: str, *, start_timeout_s: float) -> CollectiveProbe:
        """`start_timeout_s` bounds scheduling and the image pull, the collective timeout the rest."""
        self.when, self.started_wall_ns = when, time.time_ns()
        nodes = [self.kube.get("v1", "Node", n) for n in self.nodes]
        self.drivers = tuple(_driver(n) for n in nodes)
        kwok = any(is_kwok_node(n) for n in nodes)
        self.how = "simulated" if kwok else "ran"
        if self.claim_gpus:
            for count in sorted(claims.claiming(self._pod(0, ""))[1]):
                try:
                    self.kube.create(claims.template(count, self.placement.namespace, self.placement.run_id))
                except Conflict:
                    pass  # the GPU job's, of the same count
        self.kube.create(self._pod(0, ""))
        self._thread = threading.Thread(
            target=self._complete, args=(start_timeout_s,), daemon=True, name=f"collective-{when}"
        )
        self._thread.start()
        return self

    def finish(self, say: Callable[[str], None]) -> CollectiveRun:
        assert self._thread is not None, "a probe is started before it is finished"
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():
            say(f"collective probe: waiting for the {self.when} all-reduce {' <-> '.join(self.nodes)}")
            self._thread.join()
        assert self._result is not None
        return self._result

    def _pod(self, rank: int, master_addr: str) -> dict:
        pod = workloads.collective_pod(
            self.settings.collective_probe,
            self.placement,
            when=self.when,
            rank=rank,
            node=self.nodes[rank],
            master_addr=master_addr,
            images=self.settings.images(),
        )
        return claims.claiming(pod)[0] if self.claim_gpus else pod

    def _name(self, rank: int) -> str:
        return workloads.collective_name(self.when, rank)

    def _complete(self, start_timeout_s: float) -> None:
        """Never raises for the probe's own failure: a probe that does not come is a result, not an error.
        A rank still running at its timeout is deleted, so it holds no GPU past it."""
        try:
            output, ended = self._run(start_timeout_s)
        except Exception as err:  # noqa: BLE001  in a thread: whatever ended the probe is its result
            for rank in (0, 1):
                self._delete(self._name(rank))
            why = str(err) if isinstance(err, (TimeoutError, GpucanaryError)) else f"probe error: {err!r}"
            self._result = self._outcome(None, None, why)
            return
        bw = busbw_of(output)
        self._result = self._outcome(
            ended,
            bw,
            ""
            if bw is not None
            else f"rank 0 printed no '# Avg bus bandwidth' line (its output ends {output.strip()[-160:]!r})",
        )

    def _outcome(self, ended: int | None, bw: float | None, detail: str) -> CollectiveRun:
        return CollectiveRun(self.when, self.nodes, self.drivers, self.started_wall_ns, ended, bw, self.how, detail)

    def _run(self, pull_s: float) -> tuple[str, int]:
        """Rank 0's output and when both ranks were seen ended."""
        namespace = self.placement.namespace
        rank0 = self._wait(
            lambda pods: pods.get(self._name(0)) if _pod_ip(pods.get(self._name(0))) else None,
            pull_s,
            "rank 0 given a pod IP",
        )
        self.kube.create(self._pod(1, _pod_ip(rank0)))
        self._wait(
            lambda pods: (
                True
                if all(_phase(pods.get(self._name(r))) in ("Running", "Succeeded", "Failed") for r in (0, 1))
                else None
            ),
            pull_s,
            "both ranks started",
        )
        timeout_s = self.settings.collective_timeout_s
        done = self._wait(
            lambda pods: (
                pods if all(_phase(pods.get(self._name(r))) in ("Succeeded", "Failed") for r in (0, 1)) else None
            ),
            timeout_s,
            "both ranks complete",
            within=f"did not complete within {timeout_s:.0f} s of starting",
        )
        ended = time.time_ns()
        for rank in (0, 1):
            pod = done[self._name(rank)]
            if _phase(pod) == "Failed":
                raise GpucanaryError(f"rank {rank} on {self.nodes[rank]} failed: {_terminated(pod) or 'no message'}")
        return _terminated(done[self._name(0)]) or self._log(self._name(0), namespace), ended

    def _wait(self, done, timeout_s: float, what: str, *, within: str = "") -> dict:
        try:
            return self.kube.watch_until(
                "v1",
                "Pod",
                done,
                timeout_s=timeout_s,
                namespace=self.placement.namespace,
                label_selector=f"{workloads.COLLECTIVE_LABEL}={self.when}",
            )
        except TimeoutError:
            raise TimeoutError(within or f"not {what} within {timeout_s:.0f} s") from None

    def _log(self, name: str, namespace: str) -> str:
        try:
            return self.kube.pod_log(name, namespace=namespace, tail_lines=50)
        except GpucanaryError as err:
            return f"(no log: {err})"

    def _delete(self, name: str) -> None:
        try:
            self.kube.delete("v1", "Pod", name, namespace=self.placement.namespace)
        except GpucanaryError:
            pass  # gone already, or the run's namespace goes at restore and the pod with it


def _phase(pod: dict | None) -> str:
    return (pod or {}).get("status", {}).get("phase", "")


def _pod_ip(pod: dict | None) -> str:
    return (pod or {}).get("status", {}).get("podIP", "")


def _terminated(pod: dict) -> str:
    """The first container's termination message; for a failed one its exit code when it left none."""
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    terminated = (statuses[0].get("state") or {}).get("terminated") or {}
    message = terminated.get("message", "")
    if terminated.get("exitCode"):
        return message or f"exit code {terminated['exitCode']} ({terminated.get('reason', '')})"
    return message
