"""Carve existing GPU nodes out of a real cluster for the canary, and give them back exactly.

Before anything changes, each node is checked: it must be a GPU node with an operator driver pod,
run no pods the canary did not put there (unless allowed), and carry nothing of another run. It is
then marked with the run's id label and an annotation naming the run and the driver it runs, in one
patch made against the version of the node just read. Giving it back waits for that driver, then
removes exactly the label and annotation (a forged or stale annotation can make a restore write
nothing but their removal); labels, taints and cordons that others set meanwhile stay.

The fence: the same patch taints the node `gpucanary.io/run=<run-id>:NoSchedule`, so no tenant pod lands
there while the policy under test can delete or drain it (the run's pods tolerate exactly that taint).
The operator's DaemonSets must tolerate it too, or the new driver pod and the operands the driver
manager evicts could not come back; they tolerate `nvidia.com/gpu` alone by default. So the fence goes
up only when every operator DaemonSet pod on the node tolerates the key (an administrator adds
`{key: gpucanary.io/run, operator: Exists, effect: NoSchedule}` to the ClusterPolicy's
`daemonsets.tolerations` and the NVIDIADriver's `tolerations`); otherwise the run says so and relies on
the foreign-pod check right before the policy.

A node of the default NVIDIADriver (v26.7; every GPU node no other NVIDIADriver picks) cannot be upgraded
through its owner, which drives every such node. It is handed over instead, as its own step before the
policy: an NVIDIADriver of the run's own (`gpucanary-<run id>`, the default one's spec at the node's
driver, picking the nodes by the run's label) takes it, the operator replaces its driver pod under the
new owner, and the run waits for that before anything is judged. Giving it back deletes that NVIDIADriver,
so the default one takes the node again, and waits for its driver pod there (NVIDIA/gpu-operator #2518).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pytest_gpucanary.canary import neighbours
from pytest_gpucanary.canary.apply import SKIP_SET_ANNOTATION, refuse_foreign
from pytest_gpucanary.canary.pool import HANDOVER_ELIGIBLE_LABEL, POOL_ELIGIBLE_LABEL, Pool
from pytest_gpucanary.canary.pool.driver import wait_for_driver
from pytest_gpucanary.canary.pool.restore import SAVED_STATE_ANNOTATION, give_back, handover_driver
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import ConfigError, EnvError
from pytest_gpucanary.gpu_operator import (
    DRIVER_OWNER_LABEL,
    GPU_PRESENT_LABEL,
    GPU_PRESENT_SELECTOR,
    NVIDIADRIVER,
    driver_node_selector,
    driver_version_of,
    is_default_driver,
    is_driver_pod,
    of_daemonset,
)
from pytest_gpucanary.kube import Kube, patch_as_read
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import (
    FENCE_TAINT_KEY,
    RUN_ID_LABEL,
    fence_taint,
    owned_labels,
    tolerated,
)


@dataclass
class ExistingNodeProvider:
    node: str | None = None
    selector: str | None = None
    size: int = 1
    allow_foreign_pods: bool = False
    restore_timeout_s: float = 1200.0
    name: str = "existing"
    carved: list[str] = field(default_factory=list)
    driver_from: str = ""
    run_id: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> ExistingNodeProvider:
        return cls(
            node=settings.pool_node,
            selector=settings.pool_selector,
            size=settings.pool_size,
            allow_foreign_pods=settings.allow_foreign_pods,
            restore_timeout_s=settings.upgrade_budget_s,
        )

    def _candidates(self, kube: Kube) -> list[dict]:
        if self.node:
            try:
                return [kube.get("v1", "Node", self.node)]
            except NotFound:
                raise ConfigError(
                    f"node {self.node!r} does not exist in the cluster", hint=f"check {flag('pool_node')}"
                ) from None
        if not self.selector:
            raise ConfigError(
                "the existing-node pool needs a node",
                hint=f"pass {flag('pool_node')} NAME or {flag('pool_selector')} SELECTOR",
            )
        nodes = sorted(kube.list("v1", "Node", label_selector=self.selector), key=lambda n: n["metadata"]["name"])
        if len(nodes) < self.size:
            raise ConfigError(
                f"pool selector {self.selector!r} matched {len(nodes)} nodes, {self.size} needed",
                hint=f"free a node or use {flag('pool_provider')}=kwok on the local fleet",
            )
        return nodes[: self.size]

    def check(self, kube: Kube, cluster: ClusterInfo) -> None:
        nodes = self._candidates(kube)
        for node in nodes:
            self._check(kube, cluster, node)
        if cluster.nvidiadriver_mode:
            self._pool_driver(kube, tuple(n["metadata"]["name"] for n in nodes))

    def provision(self, kube: Kube, cluster: ClusterInfo, *, run_id: str) -> Pool:
        nodes = self._candidates(kube)
        checked = [self._check(kube, cluster, node) for node in nodes]
        names = tuple(n["metadata"]["name"] for n in nodes)
        driver, default = self._pool_driver(kube, names) if cluster.nvidiadriver_mode else (None, "")
        self.run_id = run_id
        unfenceable = [pod for _, pods in checked for pod in pods]
        opt_out = neighbours.nvsentinel_present(kube)
        for node, (version, _) in zip(nodes, checked):  # every check passed: only now change anything
            self._mark(
                kube, node, run_id, version, fence=not unfenceable, nvsentinel_opt_out=opt_out, handover_from=default
            )
        self.driver_from = checked[0][0]
        handed: tuple[str, ...] = ()
        if default:
            try:
                driver, took_s = self._hand_over(kube, names, default)
            except BaseException:
                self.release(kube)  # the run registers its restore only for a pool it got
                raise
            handed = (
                f"handed over from the default NVIDIADriver {default} to the run's own {driver} at driver "
                f"{self.driver_from} in {took_s:.0f} s, before the policy and not judged (a node changing "
                f"owner gets a new driver pod, NVIDIA/gpu-operator #2518); {default} takes it back after",
            )
        taint = f"{FENCE_TAINT_KEY}={run_id}:NoSchedule"
        fence = (
            f"fenced: {taint}"
            if not unfenceable
            else f"not fenced: operator pod {unfenceable[0]} does not tolerate {FENCE_TAINT_KEY} (add {{key: "
            f"{FENCE_TAINT_KEY}, operator: Exists, effect: NoSchedule}} to the ClusterPolicy's daemonsets."
            "tolerations and the NVIDIADriver's tolerations); tenant pods are checked again before the policy"
        )
        notes = handed + (
            (f"opted out of NVSentinel for the run: {neighbours.NVSENTINEL_LABEL}=false, put back as it was after",)
            if opt_out
            else ()
        )
        return Pool(names, driver, checked[0][0], fence=fence, notes=notes)

    def _check(self, kube: Kube, cluster: ClusterInfo, node: dict) -> tuple[str, list[str]]:
        """The node's driver version, and the operator's DaemonSet pods there that would not tolerate a fence."""
        name = node["metadata"]["name"]
        if node["metadata"].get("labels", {}).get(GPU_PRESENT_LABEL) != "true":
            raise ConfigError(
                f"node {name} is not a GPU node (no {GPU_PRESENT_SELECTOR} label)",
                hint="pick a node the GPU Operator manages",
            )
        on_node = kube.list("v1", "Pod", field_selector=f"spec.nodeName={name}")
        drivers = [p for p in on_node if is_driver_pod(p["metadata"].get("labels", {}))]
        if not drivers:
            raise ConfigError(f"node {name} has no GPU Operator driver pod", hint="pick a node the operator drives")
        foreign = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in on_node if not _expected(p, None)]
        if foreign and not self.allow_foreign_pods:
            raise ConfigError(
                f"node {name} runs {len(foreign)} pods the canary did not put there ({foreign[0]}...)",
                hint=f"drain it first or pass {flag('allow_foreign_pods')}",
            )
        _check_marks(node)
        probe = fence_taint("any-run")
        unfenceable = [
            f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for p in on_node
            if p["metadata"]["namespace"] == cluster.operator_namespace
            and of_daemonset(p["metadata"])
            and not tolerated(probe, (p.get("spec") or {}).get("tolerations") or [])
        ]
        return driver_version_of(drivers[0]), unfenceable

    def recheck(self, kube: Kube) -> None:
        """Right before the policy: the carved nodes still run no pods but the canary's and DaemonSets'. A tenant
        pod that landed since the carve-out would be deleted or drained by the policy under test."""
        if self.allow_foreign_pods:
            return
        for name in self.carved:
            foreign = [
                f"{p['metadata']['namespace']}/{p['metadata']['name']}"
                for p in kube.list("v1", "Pod", field_selector=f"spec.nodeName={name}")
                if not _expected(p, self.run_id) and not p["metadata"].get("deletionTimestamp")
            ]
            if foreign:
                raise EnvError(
                    f"pod {foreign[0]} landed on pool node {name} after it was carved out "
                    f"({len(foreign)} such pods): the policy under test would take it down",
                    hint="keep tenants off the node (cordon or taint it), then run again",
                )

    def _pool_driver(self, kube: Kube, names: tuple[str, ...]) -> tuple[str, str]:
        """The NVIDIADriver that drives the pool, and only it: the one the operator names in each pool node's owner
        label (v26.7), else the one whose nodeSelector picks the pool (earlier releases); with "". A default
        NVIDIADriver (v26.7, NVIDIA/gpu-operator #2518) drives every node no other picks, so it never drives the pool
        alone: for a pool it drives, ("", its name), the pool to be handed over."""
        owners = {(kube.get("v1", "Node", n)["metadata"].get("labels") or {}).get(DRIVER_OWNER_LABEL) for n in names}
        driver: dict | None
        if owners != {None}:
            if len(owners) != 1 or None in owners:
                raise ConfigError(
                    f"the pool {list(names)} is driven by different NVIDIADrivers ({sorted(map(str, owners))})",
                    hint="give the canary pool an NVIDIADriver whose nodeSelector picks only it",
                )
            [name] = owners
            assert name is not None  # one owner, and not None: checked just above
            driver = kube.get(*NVIDIADRIVER, name)
            selected = {
                n["metadata"]["name"] for n in kube.list("v1", "Node", label_selector=f"{DRIVER_OWNER_LABEL}={name}")
            }
        else:
            found = (
                (d, {n["metadata"]["name"] for n in kube.list("v1", "Node", label_selector=driver_node_selector(d))})
                for d in kube.list(*NVIDIADRIVER)
            )  # lazily: nodes are listed up to the pool's driver
            driver, selected = next(((d, s) for d, s in found if set(names) & s), (None, set()))
            if driver is None:
                raise ConfigError(f"no NVIDIADriver selects the pool {list(names)}", hint="is the GPU Operator ready?")
            name = driver["metadata"]["name"]
        if is_default_driver(driver) and set(names) <= selected:
            if (driver["metadata"].get("labels") or {}).get(HANDOVER_ELIGIBLE_LABEL) != "true":
                raise ConfigError(
                    f"the pool {list(names)} is driven by the default NVIDIADriver {name}, which is not "
                    f"marked for handing nodes to a canary run (no {HANDOVER_ELIGIBLE_LABEL}=true)",
                    hint=f"an administrator allows it: kubectl label nvidiadriver {name} "
                    f"{HANDOVER_ELIGIBLE_LABEL}=true; or give the pool an NVIDIADriver of its own",
                )
            return "", name
        if selected != set(names):
            raise ConfigError(
                f"NVIDIADriver {name} drives {len(selected)} nodes, not only the pool {list(names)}",
                hint="give the canary pool an NVIDIADriver whose nodeSelector picks only "
                "it, and wait for its driver pod: the node changing owner is a driver restart of its own, "
                "which a canary run must not judge",
            )
        if (driver["metadata"].get("labels") or {}).get(POOL_ELIGIBLE_LABEL) != "true":
            raise ConfigError(
                f"NVIDIADriver {name} of the pool is not marked eligible for canary pools "
                f"(no {POOL_ELIGIBLE_LABEL}=true)",
                hint=f"an administrator marks the NVIDIADrivers a canary may change: kubectl "
                f"label nvidiadriver {name} {POOL_ELIGIBLE_LABEL}=true",
            )
        return name, ""

    def _hand_over(self, kube: Kube, names: tuple[str, ...], default: str) -> tuple[str, float]:
        """Create the run's own NVIDIADriver, the default one's spec at the pool's driver picking the run's nodes,
        and wait until each pool node runs that driver under it. Its name and how long the handover took."""
        spec = {
            k: v for k, v in kube.get(*NVIDIADRIVER, default)["spec"].items() if k not in ("default", "nodeSelector")
        }
        name = handover_driver(self.run_id)
        kube.create(
            {
                "apiVersion": NVIDIADRIVER[0],
                "kind": NVIDIADRIVER[1],
                "metadata": {"name": name, "labels": owned_labels(self.run_id)},
                "spec": {**spec, "version": self.driver_from, "nodeSelector": {RUN_ID_LABEL: self.run_id}},
            }
        )
        started = time.monotonic()
        for node in names:
            wait_for_driver(kube, node, self.driver_from, owner=name, timeout_s=self.restore_timeout_s)
        return name, time.monotonic() - started

    def _mark(
        self,
        kube: Kube,
        node: dict,
        run_id: str,
        driver: str,
        *,
        fence: bool,
        nvsentinel_opt_out: bool = False,
        handover_from: str = "",
    ) -> None:
        """Label, annotate and fence the node in one patch against the version read; the kubelet and the
        operator change a node often, so a 409 reads it again and checks its marks again. With
        `nvsentinel_opt_out` the node leaves NVSentinel's care for the run, its label's value saved to restore;
        `handover_from` names the default NVIDIADriver that takes the node back."""
        name = node["metadata"]["name"]

        def decide(node: dict) -> tuple[dict, bool]:
            _check_marks(node)
            saved: dict = {"run_id": run_id, "driver": driver}
            if handover_from:
                saved["handover_from"] = handover_from
            labels = {RUN_ID_LABEL: run_id}
            if nvsentinel_opt_out:
                saved["nvsentinel"] = (node["metadata"].get("labels") or {}).get(neighbours.NVSENTINEL_LABEL)
                labels[neighbours.NVSENTINEL_LABEL] = "false"
            body: dict = {"metadata": {"labels": labels, "annotations": {SAVED_STATE_ANNOTATION: json.dumps(saved)}}}
            if fence:  # a merge patch replaces the list: safe against the version just read
                body["spec"] = {"taints": [*((node.get("spec") or {}).get("taints") or []), fence_taint(run_id)]}
            return body, True

        if not patch_as_read(kube, "v1", "Node", name, decide, what=f"node {name}", hint="run again", read=node):
            raise EnvError(f"node {name} was deleted while it was carved out", hint="pick another node")
        self.carved.append(name)

    def release(self, kube: Kube, report: Callable[[str], None] = print) -> None:
        """Wait until each node runs its original driver again (the restored version rolls back through
        the operator, cordon included), then take the run's mark off. A wait that runs out leaves the mark
        (and raises): the node stays the run's until `gpucanary cleanup` sees it back."""
        for name in list(self.carved):
            give_back(kube, name, self.run_id, self.driver_from, timeout_s=self.restore_timeout_s, report=report)
            self.carved.remove(name)


def _check_marks(node: dict) -> None:
    """The node is marked eligible for canary pools and carries nothing of another run."""
    name, labels = node["metadata"]["name"], node["metadata"].get("labels") or {}
    if other := labels.get(RUN_ID_LABEL):
        raise EnvError(
            f"node {name} is already in canary run {other}",
            hint=f"wait for it, or run `gpucanary cleanup --run-id {other}` if it was killed",
        )
    for annotation in (SAVED_STATE_ANNOTATION, SKIP_SET_ANNOTATION):
        refuse_foreign({"kind": "Node", **node}, annotation, run_id="")
    if labels.get(POOL_ELIGIBLE_LABEL) != "true":
        raise ConfigError(
            f"node {name} is not marked eligible for canary pools (no {POOL_ELIGIBLE_LABEL}=true)",
            hint=f"an administrator marks the nodes a canary may carve out: "
            f"kubectl label node {name} {POOL_ELIGIBLE_LABEL}=true",
        )


def _expected(pod: dict, run_id: str | None) -> bool:
    """DaemonSet pods belong on every node; the canary's own pods carry its run id (before the carve-out, when
    `run_id` is None: no other run's pods either, which `_check` refuses through the node's run id label)."""
    labels = pod["metadata"].get("labels", {})
    ours = RUN_ID_LABEL in labels if run_id is None else labels.get(RUN_ID_LABEL) == run_id
    return of_daemonset(pod["metadata"]) or ours
