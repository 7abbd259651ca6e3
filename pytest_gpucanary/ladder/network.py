"""Network: what the cluster's GPU networking depends on, on every pool node, back after the driver swap;
and, on a multi-node pool, its collective probe checks. Pure.

Discovered from what the recorder saw on each pool node before the upgrade, never configured:
- GPUDirect RDMA through the GPU Operator (`driver.rdma.enabled`): the driver pod's `nvidia-peermem-ctr`
  container (assets/state-driver/0500_daemonset.yaml, also with `rdma.useHostMofed`);
- GPUDirect Storage (`gds.enabled`): the driver pod's `nvidia-fs-ctr` container, and GDRCopy's
  `nvidia-gdrcopy-ctr` (same file);
- the NVIDIA Network Operator's MOFED driver pod (label `nvidia.com/ofed-driver`, app `mofed-<os><version>`:
  network-operator manifests/state-ofed-driver);
- RDMA and SR-IOV devices in the node's allocatable (`rdma/...` from the RDMA shared device plugin,
  names with `sriov` from the SR-IOV network device plugin's resource list).
A cluster with none of these has no GPU networking for the canary to check: skipped, saying so.
"""

from __future__ import annotations

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.ladder import timeline
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Evidence, Outcome, Stage, StageVerdict
from pytest_gpucanary.ladder.rules import Finding, at, stage_metrics, verdict

DRIVER_CONTAINERS = {"nvidia-peermem-ctr": "GPUDirect RDMA (nvidia-peermem)",
                     "nvidia-fs-ctr": "GPUDirect Storage (nvidia-fs)",
                     "nvidia-gdrcopy-ctr": "GDRCopy"}
NO_NETWORKING = "no GPU networking configured"


def is_mofed_pod(labels: dict[str, str]) -> bool:
    return "nvidia.com/ofed-driver" in labels or labels.get("app", "").startswith("mofed-")


def is_network_resource(name: str) -> bool:
    return name.startswith("rdma/") or "sriov" in name.lower()


def _containers(pod: dict) -> dict[str, bool]:
    return {c.get("name", ""): bool(c.get("ready")) for c in pod.get("status", {}).get("containerStatuses") or []}


def _latest_pod_objects(ev: RunEvidence, node: str, *, until_wall_ns: int | None = None) -> dict[str, dict]:
    """uid -> the pod object as last recorded on the node (gone pods left out)."""
    pods: dict[str, dict] = {}
    for record in ev.records:
        if record.kind != "Pod" or record.type in timeline.SKIP_TYPES:
            continue
        if until_wall_ns is not None and record.received_wall_ns > until_wall_ns:
            continue
        pod = record.object
        if pod.get("spec", {}).get("nodeName") != node:
            continue
        uid = pod.get("metadata", {}).get("uid", "")
        if record.type == "DELETED" or pod.get("metadata", {}).get("deletionTimestamp"):
            pods.pop(uid, None)
        else:
            pods[uid] = pod
    return pods


def _labels(pod: dict) -> dict[str, str]:
    return pod.get("metadata", {}).get("labels") or {}


def _network_node(ev: RunEvidence, node: str) -> tuple[list[Finding], list[Evidence]]:
    """What the node had before its upgrade cycle, and whether each is back at the end of the recording."""
    cycle = timeline.upgrade_cycle(ev.records, node, since_wall_ns=ev.upgrade_started_wall_ns)
    start_ns = cycle[0].received_wall_ns if cycle else ev.upgrade_started_wall_ns
    before, after = _latest_pod_objects(ev, node, until_wall_ns=start_ns), _latest_pod_objects(ev, node)
    findings, items = [], []
    drivers_before = [p for p in before.values() if op.is_driver_pod(_labels(p))]
    drivers_after = [p for p in after.values() if op.is_driver_pod(_labels(p))]
    for container, what in DRIVER_CONTAINERS.items():
        if not any(container in _containers(p) for p in drivers_before):
            continue
        ready = [p for p in drivers_after if _containers(p).get(container)]
        pod = (ready or drivers_after or [{}])[-1]
        name = pod.get("metadata", {}).get("name", "(none)")
        items.append(Evidence(None, None, "Pod", name, f"{container}: {'ready' if ready else 'not ready'}"))
        findings.append(Finding(Outcome.PASS, f"{what} back") if ready else Finding(
            Outcome.FAIL, f"{what}: container {container} of driver pod {name} on {node} is not ready after the "
                          f"driver swap"))
    if any(is_mofed_pod(_labels(p)) for p in before.values()):
        ready = [p for p in after.values() if is_mofed_pod(_labels(p)) and _containers(p)
                 and all(_containers(p).values())]
        items.append(Evidence(None, None, "Pod", node, f"MOFED driver pod {'Ready' if ready else 'not Ready'}"))
        findings.append(Finding(Outcome.PASS, "MOFED driver back") if ready else Finding(
            Outcome.FAIL, f"the Network Operator's MOFED driver pod on {node} is not Ready after the driver swap"))
    node_before = timeline.latest_node(ev.records, node, until_wall_ns=start_ns)
    node_after = timeline.latest_node(ev.records, node)
    for resource, count in sorted((node_before.allocatable if node_before else {}).items()):
        if not is_network_resource(resource):
            continue
        now = node_after.allocatable.get(resource) if node_after else None
        if node_after is not None:
            items.append(at(ev, node_after.received_wall_ns, "Node", node, f"{resource} = {now} (before: {count})"))
        findings.append(Finding(Outcome.PASS, f"{resource} back") if now == count else Finding(
            Outcome.FAIL, f"node {node} allocatable {resource} = {now} after the upgrade, expected {count} "
                          f"(before)"))
    return findings, items


def check_network(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    """Every pool node's GPU networking prerequisites back; a multi-node pool's collective probe checks."""
    findings, items = [], []
    for node in evidence.pool_nodes:
        node_findings, node_items = _network_node(evidence, node)
        findings += node_findings
        items += node_items
    n = len(evidence.pool_nodes)
    probe_findings, probe_items = stage_metrics(evidence, Stage.NETWORK)
    if not findings and not probe_findings:
        return StageVerdict(Stage.NETWORK, Outcome.SKIPPED,
                            f"{Stage.NETWORK.value}: {NO_NETWORKING} on the {n}-node pool (no nvidia-peermem, "
                            f"nvidia-fs or MOFED driver pod, no RDMA or SR-IOV resource)")
    if n > 1 and not probe_findings:
        probe_findings = [Finding(Outcome.INCONCLUSIVE, f"no collective probe result for the {n}-node pool (n=0)")]
    checked = sorted({f.line for f in findings if f.outcome is Outcome.PASS})
    return verdict(Stage.NETWORK, findings + probe_findings, items + probe_items,
                   f"{n}/{n} pool nodes: {', '.join(checked) or 'collective probe passed'} after the driver swap"
                   f"{'' if n > 1 else ' (one-node pool: no collective probe)'}")
