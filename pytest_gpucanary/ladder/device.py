"""Device: on each pool node after upgrade-done, the validator Ready, GPUs allocatable as before, the
driver image at the target version, and the device metrics clean. Pure: judges a RunEvidence.
"""

from __future__ import annotations

from typing import Callable, Mapping

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.ladder import timeline
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Evidence, Outcome, Stage, StageVerdict
from pytest_gpucanary.ladder.rules import Finding, stage_metrics, metrics_note, verdict

def _live_on(ev: RunEvidence, node: str, is_operand: Callable[[Mapping[str, str]], bool]) -> list[timeline.PodSeen]:
    return [p for p in timeline.live_pods(ev.records, node=node) if is_operand(p.labels)]


def _device_node(ev: RunEvidence, node: str) -> tuple[list[Finding], list[Evidence]]:
    cycle = timeline.upgrade_cycle(ev.records, node, since_wall_ns=ev.upgrade_started_wall_ns)
    done = next((t for t in cycle if t.state == "upgrade-done"), None)
    if done is None:
        return [Finding(Outcome.INCONCLUSIVE, f"node {node} never reached upgrade-done; device state not judged")], []
    findings, items = [], []
    for finding, pods in (_validator(ev, node), _driver(ev, node)):
        findings.append(finding)
        items += [Evidence(p.received_wall_ns, ev.offset_s(p.received_wall_ns), "Pod", f"{p.namespace}/{p.name}",
                           f"{p.phase}, {p.ready_containers}/{p.containers} containers ready, images "
                           f"{', '.join(p.images) or 'none reported'}") for p in pods]
    before = timeline.latest_node(ev.records, node, until_wall_ns=cycle[0].received_wall_ns)
    after = timeline.latest_node(ev.records, node)
    pre, post = (s.allocatable.get(op.GPU_RESOURCE) if s else None for s in (before, after))
    if pre is None:
        findings.append(Finding(Outcome.INCONCLUSIVE, f"node {node} had no {op.GPU_RESOURCE} allocatable recorded "
                                                      f"before the upgrade"))
    elif post != pre:
        findings.append(Finding(Outcome.FAIL, f"node {node} allocatable {op.GPU_RESOURCE} = {post} after upgrade-done, "
                                              f"expected {pre} (before the upgrade)"))
    if after is not None:
        items.append(Evidence(after.received_wall_ns, ev.offset_s(after.received_wall_ns), "Node", node,
                              f"allocatable {op.GPU_RESOURCE} = {post} (before the upgrade: {pre})"))
    return findings, items


def _validator(ev: RunEvidence, node: str) -> tuple[Finding, list[timeline.PodSeen]]:
    pods = _live_on(ev, node, op.is_validator_pod)
    if not pods:
        return Finding(Outcome.INCONCLUSIVE, f"no live {op.VALIDATOR_SELECTOR} pod recorded on {node}"), []
    if any(p.phase == "Running" and p.ready for p in pods):
        return Finding(Outcome.PASS, "validator ready"), pods
    p = pods[-1]
    return Finding(Outcome.FAIL, f"validator pod {p.namespace}/{p.name} on {node} is {p.phase or 'unknown'} with "
                                 f"{p.ready_containers}/{p.containers} containers ready after upgrade-done "
                                 f"(expected Running, all ready)"), pods


def _driver(ev: RunEvidence, node: str) -> tuple[Finding, list[timeline.PodSeen]]:
    pods = _live_on(ev, node, op.is_driver_pod)
    if not pods:
        return Finding(Outcome.INCONCLUSIVE, f"no live driver pod recorded on {node} "
                                             f"(label {op.DRIVER_COMPONENT_SELECTOR})"), []
    p = pods[-1]
    tags = [op.image_tag(i) for i in p.images]
    if not tags:
        return Finding(Outcome.INCONCLUSIVE, f"driver pod {p.namespace}/{p.name} reports no container image"), pods
    if any(t.startswith(ev.driver_to) for t in tags):
        return Finding(Outcome.PASS, f"driver tag {tags[0]}"), pods
    return Finding(Outcome.FAIL, f"driver pod {p.namespace}/{p.name} on {node} runs tag {tags[0]}, expected a tag "
                                 f"starting {ev.driver_to}"), pods


def check_device(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    """After upgrade-done: validator ready, nvidia.com/gpu allocatable restored, driver image at the target."""
    findings, items = [], []
    for node in evidence.pool_nodes:
        node_findings, node_items = _device_node(evidence, node)
        findings += node_findings
        items += node_items
    if not evidence.pool_nodes:
        findings.append(Finding(Outcome.INCONCLUSIVE, "no pool nodes given"))
    metric_findings, metric_items = stage_metrics(evidence, Stage.DEVICE)
    n = len(evidence.pool_nodes)
    pass_line = (f"{n}/{n} pool nodes: validator Running and ready, {op.GPU_RESOURCE} allocatable restored, driver "
                 f"image tag starts with {evidence.driver_to}{metrics_note(metric_findings)}")
    return verdict(Stage.DEVICE, findings + metric_findings, items + metric_items, pass_line)
