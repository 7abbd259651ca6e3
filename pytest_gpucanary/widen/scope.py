"""What a sweep reaches: the object that carries the driver version (an NVIDIADriver an administrator marked
for widen, or the ClusterPolicy), the version it is at, and its nodes less those held by someone else or carved
out as a canary pool; a node that joins while the sweep runs is taken into the wave about to start.
"""

from __future__ import annotations

from collections.abc import Callable

from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary.pool.existing_node import SAVED_STATE_ANNOTATION
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY,
    DRIVER_OWNER_LABEL,
    NVIDIADRIVER,
    SKIP_LABEL,
    driver_node_selector,
)
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.ownership import OWNER, OWNER_LABEL
from pytest_gpucanary.widen.state import Sweep

# A sweep moves an NVIDIADriver only when an administrator set this label to "true" on it; deploy/admission.yaml
# lets the sweep's own ServiceAccount (deploy/rbac-widen.yaml), and no other of the canary's, change such a one.
WIDEN_ELIGIBLE_LABEL = "gpucanary.io/widen-eligible"


def target(
    kube: Kube, cluster: ClusterInfo, name: str | None, report: Callable[[str], None]
) -> tuple[tuple[str, str, str], str, list[str]]:
    """What carries the version (the NVIDIADriver, or the ClusterPolicy), the version it is at, and its nodes
    less those held by someone else or carved out as a canary pool."""
    if cluster.nvidiadriver_mode:
        drivers = {
            d["metadata"]["name"]: d
            for d in kube.list(*NVIDIADRIVER)
            if (d["metadata"].get("labels") or {}).get(OWNER_LABEL) != OWNER
        }
        if name is None and len(drivers) != 1:
            raise ConfigError(
                f"the cluster has {len(drivers)} NVIDIADrivers: name the one to widen",
                hint=f"--nvidiadriver NAME, one of: {', '.join(sorted(drivers)) or '(none)'}",
            )
        name = name or next(iter(drivers))
        if name not in drivers:
            raise ConfigError(
                f"no NVIDIADriver {name} (other than canary pools') in the cluster",
                hint=f"one of: {', '.join(sorted(drivers)) or '(none)'}",
            )
        driver = drivers[name]
        if (driver["metadata"].get("labels") or {}).get(WIDEN_ELIGIBLE_LABEL) != "true":
            raise ConfigError(
                f"NVIDIADriver {name} is not marked for gpucanary widen (no {WIDEN_ELIGIBLE_LABEL}=true)",
                hint=f"an administrator marks the NVIDIADrivers a sweep may roll out: kubectl label "
                f"nvidiadriver {name} {WIDEN_ELIGIBLE_LABEL}=true",
            )
        nodes = list(kube.each("v1", "Node", label_selector=f"{DRIVER_OWNER_LABEL}={name}")) or list(
            kube.each("v1", "Node", label_selector=driver_node_selector(driver))
        )
        target, prior = (*NVIDIADRIVER, name), str(driver["spec"].get("version") or "")
    else:
        policy = kube.get(*CLUSTER_POLICY, cluster.policy_name)
        nodes = [{"metadata": n["metadata"]} for n in upgrade.driver_nodes(kube).values()]
        target = (*CLUSTER_POLICY, cluster.policy_name)
        prior = str(((policy.get("spec") or {}).get("driver") or {}).get("version") or "")
    ours = []
    for node in nodes:
        meta = node["metadata"]
        if (meta.get("labels") or {}).get(SKIP_LABEL) == "true":
            report(f"widen: node {meta['name']} is held by someone else (its skip label): left out of the sweep")
        elif SAVED_STATE_ANNOTATION in (meta.get("annotations") or {}):
            report(f"widen: node {meta['name']} is a canary run's pool: left out of the sweep")
        else:
            ours.append(meta["name"])
    return target, prior, ours


def take_joined(kube: Kube, cluster: ClusterInfo, sweep: Sweep, index: int, report: Callable[[str], None]) -> None:
    """A node the change reaches that joined since the sweep started gets its first driver pod from the driver
    DaemonSet's current template, which is the target version: the skip label holds an upgrade, not a first
    install. It is judged with the wave about to start."""
    _, _, nodes = target(kube, cluster, sweep.target[2] if cluster.nvidiadriver_mode else None, lambda line: None)
    if joined := sorted(set(nodes) - set(sweep.nodes())):
        sweep.waves[index].nodes.extend(joined)
        report(
            f"widen: {', '.join(joined)} joined, on the target driver from its first install: judged in wave "
            f"{index + 1}"
        )
