"""Network: what the cluster's GPU networking depends on, on every pool node, back after the driver swap;
and the collective probe across the upgrade boundary (an all-reduce between a pool node on the new
driver and a peer on the old one, or two pool nodes), after vs its baseline. Pure.

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

from collections.abc import Sequence

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.ladder import timeline
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Evidence, Outcome, Stage, StageVerdict
from pytest_gpucanary.ladder.rules import Finding, at, stage_metrics, verdict
from pytest_gpucanary.ladder.timeline import Record

DRIVER_CONTAINERS = {
    "nvidia-peermem-ctr": "GPUDirect RDMA (nvidia-peermem)",
    "nvidia-fs-ctr": "GPUDirect Storage (nvidia-fs)",
    "nvidia-gdrcopy-ctr": "GDRCopy",
}
NO_NETWORKING = "no GPU networking configured"


def is_mofed_pod(labels: dict[str, str]) -> bool:
    return "nvidia.com/ofed-driver" in labels or labels.get("app", "").startswith("mofed-")


def is_network_resource(name: str) -> bool:
    return name.startswith("rdma/") or "sriov" in name.lower()


def _containers(pod: dict) -> dict[str, bool]:
    return {c.get("name", ""): bool(c.get("ready")) for c in pod.get("status", {}).get("containerStatuses") or []}


def _latest_pod_objects(records: Sequence[Record], node: str, *, until_wall_ns: int | None = None) -> dict[str, dict]:
    """uid -> the pod object as last recorded on the node (gone pods left out)."""
    pods: dict[str, dict] = {}
    for record in records:
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


def networking_on(records: Sequence[Record], node: str) -> list[str]:
    """What of the cluster's GPU networking the node shows in the records so far (empty: none): what
    the run decides the collective probe on, before anything changes."""
    pods = _latest_pod_objects(records, node).values()
    found = [
        what
        for container, what in DRIVER_CONTAINERS.items()
        if any(container in _containers(p) for p in pods if op.is_driver_pod(_labels(p)))
    ]
    if any(is_mofed_pod(_labels(p)) for p in pods):
        found.append("MOFED driver")
    seen = timeline.latest_node(records, node)
    return found + sorted(r for r in (seen.allocatable if seen else {}) if is_network_resource(r))


def _network_node(ev: RunEvidence, node: str) -> tuple[list[Finding], list[Evidence]]:
    """What the node had before its upgrade cycle, and whether each is back at the end of the recording."""
    cycle = ev.index.upgrade_cycle(node, since_wall_ns=ev.upgrade_started_wall_ns)
    start_ns = cycle[0].received_wall_ns if cycle else ev.upgrade_started_wall_ns
    on_node = ev.index.pod_records_on(node)
    before, after = _latest_pod_objects(on_node, node, until_wall_ns=start_ns), _latest_pod_objects(on_node, node)
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
        findings.append(
            Finding(Outcome.PASS, f"{what} back")
            if ready
            else Finding(
                Outcome.FAIL,
                f"{what}: container {container} of driver pod {name} on {node} is not ready after the driver swap",
            )
        )
    if any(is_mofed_pod(_labels(p)) for p in before.values()):
        ready = [
            p for p in after.values() if is_mofed_pod(_labels(p)) and _containers(p) and all(_containers(p).values())
        ]
        items.append(Evidence(None, None, "Pod", node, f"MOFED driver pod {'Ready' if ready else 'not Ready'}"))
        findings.append(
            Finding(Outcome.PASS, "MOFED driver back")
            if ready
            else Finding(
                Outcome.FAIL, f"the Network Operator's MOFED driver pod on {node} is not Ready after the driver swap"
            )
        )
    node_before = ev.index.latest_node(node, until_wall_ns=start_ns)
    node_after = ev.index.latest_node(node)
    for resource, count in sorted((node_before.allocatable if node_before else {}).items()):
        if not is_network_resource(resource):
            continue
        now = node_after.allocatable.get(resource) if node_after else None
        if node_after is not None:
            items.append(at(ev, node_after.received_wall_ns, "Node", node, f"{resource} = {now} (before: {count})"))
        findings.append(
            Finding(Outcome.PASS, f"{resource} back")
            if now == count
            else Finding(
                Outcome.FAIL, f"node {node} allocatable {resource} = {now} after the upgrade, expected {count} (before)"
            )
        )
    return findings, items


def _collective(ev: RunEvidence, settings: Settings) -> tuple[list[Finding], list[Evidence]]:
    """The after run held against the baseline: complete within its timeout, bus bandwidth at least
    `min_busbw_ratio` of the baseline's. A baseline without a figure leaves nothing to hold it against."""
    runs = {run.when: run for run in ev.collective}
    items = [at(ev, run.started_wall_ns, "Collective", " <-> ".join(run.nodes), run.line()) for run in ev.collective]
    base, after = runs.get("baseline"), runs.get("after")
    if base is None or base.busbw_gbps is None:
        why = base.line() if base else "no baseline run"
        return [
            Finding(Outcome.INCONCLUSIVE, f"collective probe: no baseline figure to hold the after run against ({why})")
        ], items
    if after is None:
        return [
            Finding(Outcome.INCONCLUSIVE, "collective probe: no run after the upgrade (the pool never came back)")
        ], items
    pair = " <-> ".join(after.nodes)
    if after.busbw_gbps is None:
        return [
            Finding(
                Outcome.FAIL,
                f"collective probe {pair} after the driver swap: {after.detail or 'no result'} "
                f"(baseline {base.busbw_gbps:.2f} GB/s)",
            )
        ], items
    floor = settings.min_busbw_ratio * base.busbw_gbps
    if after.busbw_gbps < floor:
        return [
            Finding(
                Outcome.FAIL,
                f"collective probe {pair} after the driver swap: bus bandwidth "
                f"{after.busbw_gbps:.2f} GB/s, below {settings.min_busbw_ratio:.0%} of the "
                f"baseline {base.busbw_gbps:.2f} GB/s",
            )
        ], items
    return [
        Finding(
            Outcome.PASS,
            f"collective probe {after.busbw_gbps:.2f} GB/s after vs {base.busbw_gbps:.2f} GB/s "
            f"baseline ({pair}, {after.how})",
        )
    ], items


def check_network(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    """Every pool node's GPU networking prerequisites back; a multi-node pool's collective probe checks."""
    findings, items = [], []
    for node in evidence.pool_nodes:
        node_findings, node_items = _network_node(evidence, node)
        findings += node_findings
        items += node_items
    n = len(evidence.pool_nodes)
    probe_findings, probe_items = stage_metrics(evidence, Stage.NETWORK, settings)
    if evidence.collective:
        collective, collective_items = _collective(evidence, settings)
        probe_findings, probe_items = collective + probe_findings, collective_items + probe_items
    if not findings and not probe_findings:
        return StageVerdict(
            Stage.NETWORK,
            Outcome.SKIPPED,
            f"{Stage.NETWORK.value}: {NO_NETWORKING} on the {n}-node pool (no nvidia-peermem, "
            f"nvidia-fs or MOFED driver pod, no RDMA or SR-IOV resource)",
        )
    if n > 1 and not probe_findings:
        probe_findings.append(
            Finding(
                Outcome.INCONCLUSIVE,
                f"no collective probe result for the {n}-node pool (n=0"
                f"{'; ' + evidence.collective_note if evidence.collective_note else ''})",
            )
        )
    checked = sorted({f.line for f in findings if f.outcome is Outcome.PASS})
    probe = next((f.line for f in probe_findings if f.line.startswith("collective probe ")), None)
    return verdict(
        Stage.NETWORK,
        findings + probe_findings,
        items + probe_items,
        f"{n}/{n} pool nodes: {', '.join(checked) or 'no prerequisite'} after the driver swap; "
        f"{probe or (evidence.collective_note or 'no collective probe')}",
    )
