"""Device: on each pool node, evidence of the new driver and of nothing older. The driver pod at the
target version Ready; after it, a validator pod Ready and a device plugin pod Ready; the GPUs back in
allocatable after their dip, within a bound; GPU Feature Discovery's driver label at the target; on a
node that offers its GPUs through DRA, its ResourceSlices gone and back at the target (`slices`); the
device metrics clean. Pure: judges a RunEvidence.

Order matters because a validator or device plugin pod that was Ready before the new driver was
validating the old one: on a real node the driver manager removes both while it swaps the driver,
and the operator recreates them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.ladder import slices, timeline
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import CapacityDip, Evidence, Outcome, Stage, StageVerdict
from pytest_gpucanary.ladder.rules import Finding, at, metrics_note, stage_metrics, verdict


def _pods_on(ev: RunEvidence, node: str, is_operand: Callable[[Mapping[str, str]], bool]) -> list[timeline.PodSeen]:
    return [p for p in ev.index.pods_on(node) if is_operand(p.labels)]


def _describe(p: timeline.PodSeen) -> str:
    return f"{p.phase or 'unknown'}, {p.ready_containers}/{p.containers} containers ready"


def _pod_evidence(ev: RunEvidence, p: timeline.PodSeen) -> Evidence:
    ready = f"Ready at {ev.offset_s(p.ready_wall_ns):+.1f}s" if p.ready_wall_ns else "never Ready"
    gone = f", gone at {ev.offset_s(p.removed_wall_ns):+.1f}s" if p.removed_wall_ns else ""
    images = ", ".join(p.images) or "none reported"
    return at(
        ev,
        p.ready_wall_ns or p.first_seen_wall_ns,
        "Pod",
        f"{p.namespace}/{p.name}",
        f"{ready}{gone}; {_describe(p)}; images {images}",
    )


def validator_line(ev: RunEvidence, node: str) -> str:
    """Why a node waits in validation-required: its validator pod as last seen, or that it has none."""
    live = [p for p in _pods_on(ev, node, op.is_validator_pod) if p.removed_wall_ns is None]
    if not live:
        return (
            f"no {op.VALIDATOR_SELECTOR} pod on {node}: the operator waits in {op.VALIDATION_REQUIRED} "
            f"without ever starting its validation timeout"
        )
    p = live[-1]
    return (
        f"validator pod {p.namespace}/{p.name} is {_describe(p)} since {ev.offset_s(p.first_seen_wall_ns):+.0f}s "
        f"(the operator fails the node after its 600 s validation timeout)"
    )


def _new_driver(ev: RunEvidence, node: str) -> tuple[Finding, timeline.PodSeen | None, list[Evidence]]:
    pods = _pods_on(ev, node, op.is_driver_pod)
    items = [_pod_evidence(ev, p) for p in pods]
    at_target = [p for p in pods if any(op.image_tag(i).startswith(ev.driver_to) for i in p.images)]
    ready = [p for p in at_target if p.ready_wall_ns]
    if ready:
        p = ready[-1]
        return Finding(Outcome.PASS, f"driver pod {p.name} Ready"), p, items
    live = [p for p in pods if p.removed_wall_ns is None]
    if not live:
        return (
            Finding(
                Outcome.INCONCLUSIVE, f"no live driver pod recorded on {node} (label {op.DRIVER_COMPONENT_SELECTOR})"
            ),
            None,
            items,
        )
    p = live[-1]
    tags = [op.image_tag(i) for i in p.images]
    if not tags:
        return (
            Finding(Outcome.INCONCLUSIVE, f"driver pod {p.namespace}/{p.name} reports no container image"),
            None,
            items,
        )
    if not at_target:
        return (
            Finding(
                Outcome.FAIL,
                f"driver pod {p.namespace}/{p.name} on {node} runs tag {tags[0]}, expected a tag "
                f"starting {ev.driver_to}",
            ),
            None,
            items,
        )
    return (
        Finding(
            Outcome.FAIL,
            f"driver pod {p.namespace}/{p.name} on {node} at {tags[0]} never became Ready ({_describe(p)})",
        ),
        None,
        items,
    )


def _ready_after(
    ev: RunEvidence, node: str, what: str, is_operand: Callable[[Mapping[str, str]], bool], driver: timeline.PodSeen
) -> tuple[Finding, list[Evidence]]:
    """A pod of this operand Ready after the new driver pod was; one line with both times if only older ones were."""
    pods = _pods_on(ev, node, is_operand)
    items = [_pod_evidence(ev, p) for p in pods]
    driver_ready_wall_ns = driver.ready_wall_ns
    assert driver_ready_wall_ns is not None  # _new_driver hands over only a Ready driver pod
    driver_ready_s = ev.offset_s(driver_ready_wall_ns)
    if any(p.ready_wall_ns and p.ready_wall_ns > driver_ready_wall_ns for p in pods):
        return Finding(Outcome.PASS, f"{what} Ready after the new driver"), items
    older = [(p, p.ready_wall_ns) for p in pods if p.ready_wall_ns]
    live = [p for p in pods if p.removed_wall_ns is None]
    if older:
        p, ready_wall_ns = older[-1]
        return Finding(
            Outcome.FAIL,
            f"{what} pod {p.namespace}/{p.name} on {node} was Ready at "
            f"{ev.offset_s(ready_wall_ns):+.1f}s, before the new driver pod {driver.name} "
            f"at {driver_ready_s:+.1f}s: it checked the old driver, and none was Ready "
            f"after",
        ), items
    if live:
        p = live[-1]
        return Finding(
            Outcome.FAIL,
            f"{what} pod {p.namespace}/{p.name} on {node} is {_describe(p)}, not Ready "
            f"since the new driver pod {driver.name} was at {driver_ready_s:+.1f}s",
        ), items
    return Finding(Outcome.INCONCLUSIVE, f"no {what} pod recorded on {node}"), items


DEVICE_PLUGIN, DRA_PLUGIN = "device plugin", "DRA kubelet plugin"


def capacity_dip(ev: RunEvidence, node: str) -> CapacityDip:
    """The node's GPUs leaving allocatable during its upgrade cycle and their return."""
    cycle = ev.index.upgrade_cycle(node, since_wall_ns=ev.upgrade_started_wall_ns)
    series = ev.index.allocatable_series(node, op.GPU_RESOURCE)
    start_ns = cycle[0].received_wall_ns if cycle else ev.upgrade_started_wall_ns
    before = next((v for t, v in reversed(series) if t <= start_ns), None)
    during = [(t, v) for t, v in series if t > start_ns]
    after = series[-1][1] if series else None
    shown = tuple((ev.offset_s(t), v) for t, v in series)
    if before is None:
        return CapacityDip(node, None, None, None, None, after, shown)
    left = next((t for t, v in during if (v or 0) < before), None)
    back = next((t for t, v in during if left is not None and t > left and (v or 0) >= before), None)
    lowest = min(
        [before] + [v or 0 for t, v in during if left is not None and t >= left and (back is None or t < back)]
    )
    return CapacityDip(
        node, before, lowest, ev.offset_s(left) if left else None, ev.offset_s(back) if back else None, after, shown
    )


def _capacity(ev: RunEvidence, node: str, dip: CapacityDip, settings: Settings) -> Finding:
    if dip.before is None:
        return Finding(
            Outcome.INCONCLUSIVE, f"node {node} had no {op.GPU_RESOURCE} allocatable recorded before the upgrade"
        )
    if dip.after != dip.before:
        return Finding(
            Outcome.FAIL,
            f"node {node} allocatable {op.GPU_RESOURCE} = {dip.after} after upgrade-done, "
            f"expected {dip.before} (before the upgrade)",
        )
    if dip.gone_s is not None and dip.gone_s > settings.max_gpus_gone_s:
        return Finding(
            Outcome.FAIL,
            f"node {node}'s GPUs were gone from allocatable for {dip.gone_s:.0f} s > {settings.max_gpus_gone_s:.0f} s",
        )
    return Finding(Outcome.PASS, dip.line())


def _driver_label(ev: RunEvidence, node: str) -> tuple[Finding | None, list[Evidence]]:
    seen = ev.index.latest_node(node)
    version = seen.labels.get(op.DRIVER_VERSION_LABEL) if seen else None
    if seen is None or version is None:
        return None, []  # GPU Feature Discovery off: the DCGM metric check still reads the driver
    item = at(ev, seen.received_wall_ns, "Node", node, f"{op.DRIVER_VERSION_LABEL}={version}")
    if version.startswith(ev.driver_to):
        return None, [item]
    return Finding(
        Outcome.FAIL,
        f"node {node} label {op.DRIVER_VERSION_LABEL}={version} after the upgrade, expected {ev.driver_to}",
    ), [item]


def _device_node(
    ev: RunEvidence, node: str, settings: Settings
) -> tuple[list[Finding], list[Evidence], CapacityDip, str]:
    """The node's findings, their evidence, its capacity dip and the plugin that offers its GPUs."""
    dip = capacity_dip(ev, node)
    cycle = ev.index.upgrade_cycle(node, since_wall_ns=ev.upgrade_started_wall_ns)
    states = [t.state for t in cycle]
    # a node that offers its GPUs only through DRA (GPUCluster mode: no device plugin, no nvidia.com/gpu): the DRA
    # kubelet plugin stands where the device plugin would, and its ResourceSlices (judged below) for allocatable
    dra_only = (
        dip.before is None and not _pods_on(ev, node, op.is_device_plugin_pod) and bool(slices.slice_cycle(ev, node))
    )
    plugin = (DRA_PLUGIN, op.is_dra_kubelet_plugin_pod) if dra_only else (DEVICE_PLUGIN, op.is_device_plugin_pod)
    if "upgrade-done" not in states:
        held = states[-1:] == [op.VALIDATION_REQUIRED] or states[-2:] == [op.VALIDATION_REQUIRED, op.UPGRADE_FAILED]
        if held:
            where = "failed in" if states[-1] == op.UPGRADE_FAILED else "held in"
            return (
                [Finding(Outcome.FAIL, f"node {node} {where} {op.VALIDATION_REQUIRED}: {validator_line(ev, node)}")],
                [_pod_evidence(ev, p) for p in _pods_on(ev, node, op.is_validator_pod)],
                dip,
                plugin[0],
            )
        return (
            [Finding(Outcome.INCONCLUSIVE, f"node {node} never reached upgrade-done; device state not judged")],
            [],
            dip,
            plugin[0],
        )
    finding, driver, items = _new_driver(ev, node)
    findings = [finding]
    if driver is not None:
        for what, is_operand in (("validator", op.is_validator_pod), plugin):
            operand_finding, operand_items = _ready_after(ev, node, what, is_operand, driver)
            findings.append(operand_finding)
            items += operand_items
    if not dra_only:
        findings.append(_capacity(ev, node, dip, settings))
        items.append(Evidence(None, None, "Node", node, f"{op.GPU_RESOURCE} {dip.line()}"))
    label_finding, label_items = _driver_label(ev, node)
    findings += [label_finding] if label_finding else []
    slice_finding, slice_items = slices.judge(ev, node)
    findings += [slice_finding] if slice_finding else []
    return findings, items + label_items + slice_items, dip, plugin[0]


def capacity_dips(evidence: RunEvidence) -> tuple[CapacityDip, ...]:
    return tuple(capacity_dip(evidence, node) for node in evidence.pool_nodes)


def check_device(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    findings, items, dips, plugins = [], [], [], set()
    for node in evidence.pool_nodes:
        node_findings, node_items, dip, plugin = _device_node(evidence, node, settings)
        findings += node_findings
        items += node_items
        dips.append(dip)
        plugins.add(plugin)
    if not evidence.pool_nodes:
        findings.append(Finding(Outcome.INCONCLUSIVE, "no pool nodes given"))
    metric_findings, metric_items = stage_metrics(evidence, Stage.DEVICE, settings)
    n = len(evidence.pool_nodes)
    back = [d.back_s for d in dips if d.back_s is not None]
    gone = [d.gone_s for d in dips if d.gone_s is not None]
    capacity = (
        f"GPUs gone at most {max(gone):.0f} s, all back by +{max(back):.0f}s"
        if gone
        else f"{op.GPU_RESOURCE} allocatable as before"
    )
    republished = len({e.ref for e in items if e.kind == slices.KIND})  # nodes whose slices were judged (passed)
    dra = f"; {slices.GPU_DRIVER} ResourceSlices republished at the target on {republished}" if republished else ""
    if plugins == {DRA_PLUGIN}:  # every node offers its GPUs only through DRA: its slices are its capacity
        capacity_part = dra.removeprefix("; ")
    else:
        capacity_part = f"{capacity} (<= {settings.max_gpus_gone_s:.0f} s){dra}"
    pass_line = (
        f"{n}/{n} pool nodes: driver {evidence.driver_to} Ready, then validator and {' / '.join(sorted(plugins))} "
        f"Ready; {capacity_part}{metrics_note(metric_findings)}"
    )
    return verdict(Stage.DEVICE, findings + metric_findings, items + metric_items, pass_line)
