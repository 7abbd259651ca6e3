"""Rollout: every pool node went from upgrade-required to upgrade-done within the budget, and if not, why.

Pure: judges a RunEvidence. The operator logs but does not emit why an upgrade failed, so the likely
cause is derived from the step that failed, the pods then on the node and the policy applied.
"""

from __future__ import annotations

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder import diagnosis, stall, timeline
from pytest_gpucanary.ladder.cause import EVICTION_REFUSED, Cause
from pytest_gpucanary.ladder.device import validator_line
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Evidence, Outcome, Stage, StageVerdict
from pytest_gpucanary.ladder.rules import Finding, metrics_note, stage_metrics, verdict


def _state_evidence(ev: RunEvidence, node: str, cycle: list[timeline.Transition]) -> list[Evidence]:
    items = [
        Evidence(
            t.received_wall_ns,
            ev.offset_s(t.received_wall_ns),
            "Node",
            node,
            f"{UPGRADE_STATE_LABEL}={t.state or '(none)'}",
        )
        for t in cycle
    ]
    items += [
        Evidence(
            e.received_wall_ns,
            ev.offset_s(e.received_wall_ns),
            "Event",
            f"{e.namespace}/{node}",
            f"{e.type} {e.reason}: {e.message}",
        )
        for e in ev.index.node_events(node)
        if e.received_wall_ns >= ev.upgrade_started_wall_ns
    ]
    return sorted(items, key=lambda i: i.received_wall_ns or 0)


def why_failed(ev: RunEvidence, node: str, cycle: list[timeline.Transition]) -> str:
    """The likely cause of an upgrade-failed, from the step that failed, the pods then on the node and the
    policy (the operator logs the cause but emits no event for it)."""
    if len(cycle) < 2:
        return ""
    step, failed = cycle[-2], cycle[-1]
    pods = [
        p
        for p in ev.index.latest_pods(until_wall_ns=failed.received_wall_ns, ever_on=node)
        if p.node == node
        and p.removed_wall_ns is None
        and p.phase in ("Running", "Pending")
        and "DaemonSet" not in p.owner_kinds
    ]
    knobs = {"pod-deletion-required": "podDeletion", "drain-required": "drain"}
    if step.state == op.VALIDATION_REQUIRED:
        return validator_line(ev, node)
    if step.state not in knobs:
        return f"failed in {step.state}"
    knob = knobs[step.state]
    spec = ev.upgrade_policy.get(knob, {})
    candidates = [p for p in pods if p.gpus > 0] if knob == "podDeletion" else pods
    for pod in candidates:
        if pod.empty_dirs and not spec.get("deleteEmptyDir", False):
            return (
                f"{knob} refused {'GPU ' if pod.gpus else ''}pod {pod.namespace}/{pod.name} with emptyDir "
                f"{','.join(pod.empty_dirs)} ({knob}.deleteEmptyDir=false)"
            )
        if not pod.owner_kinds and not spec.get("force", False):
            return f"{knob} refused unmanaged pod {pod.namespace}/{pod.name} ({knob}.force=false)"
    waited_s = (failed.received_wall_ns - step.received_wall_ns) / 1e9
    timeout_s = spec.get("timeoutSeconds")
    until = [r for r in ev.index.stall_records(node) if r.received_wall_ns < failed.received_wall_ns]
    refused = [
        c
        for c in stall.causes(until, node, since_wall_ns=step.received_wall_ns, policy=ev.upgrade_policy)
        if c.reason == EVICTION_REFUSED
    ]
    if refused:
        return f"{knob} gave up after {waited_s:.0f} s: {refused[0].what}: {refused[0].message}"
    if timeout_s and waited_s >= timeout_s - 1:
        return (
            f"{knob} gave up after {waited_s:.0f} s ({knob}.timeoutSeconds={timeout_s}; "
            "a PodDisruptionBudget or a slow termination held the pods)"
        )
    return f"{knob} failed after {waited_s:.0f} s"


def stall_of(ev: RunEvidence, node: str, settings: Settings) -> Cause | None:
    """The cause on the node that would not clear by itself, judged when the run froze its evidence."""
    return stall.terminal(
        ev.index.stall_records(node),
        [node],
        since_wall_ns=ev.upgrade_started_wall_ns,
        policy=ev.upgrade_policy,
        now_wall_ns=ev.frozen_wall_ns(),
        stuck_s=settings.stall_s,
    )


def _rollout_node(ev: RunEvidence, node: str, settings: Settings) -> tuple[Finding, float | None]:
    """One node's finding, and its time to upgrade-done (s from upgrade start) when it got there."""
    budget = f"budget {settings.upgrade_budget_s:.0f} s"
    every = ev.index.label_transitions(node, UPGRADE_STATE_LABEL)
    if not every:
        return Finding(Outcome.INCONCLUSIVE, f"no Node records for pool node {node}"), None
    cycle = ev.index.upgrade_cycle(node, since_wall_ns=ev.upgrade_started_wall_ns)
    states = [t.state for t in cycle]
    if "upgrade-failed" in states:
        failed = cycle[states.index("upgrade-failed")]
        path = " -> ".join(states[: states.index("upgrade-failed") + 1])
        failed_s = ev.offset_s(failed.received_wall_ns)
        why = why_failed(ev, node, cycle[: states.index("upgrade-failed") + 1])
        return Finding(
            Outcome.FAIL,
            f"node {node} reached upgrade-failed at +{failed_s:.0f}s via {path}"
            f"{': ' + why if why else ''} (expected upgrade-done within {budget})",
        ), None
    if "upgrade-done" in states:
        done_s = ev.offset_s(cycle[states.index("upgrade-done")].received_wall_ns)
        if done_s > settings.upgrade_budget_s:
            return Finding(Outcome.FAIL, f"node {node} reached upgrade-done at +{done_s:.0f}s > {budget}"), done_s
        return Finding(Outcome.PASS, f"node {node} reached upgrade-done at +{done_s:.0f}s"), done_s
    current = states[-1] if states else (every[-1].state or "unlabelled")
    where = f"in {current}" if states else f"never entered upgrade-required (last state {current})"
    held = f" ({validator_line(ev, node)})" if current == op.VALIDATION_REQUIRED else ""
    if (stuck := stall_of(ev, node, settings)) is not None and stuck.terminal_wall_ns is not None:
        said = diagnosis.last_meaningful(diagnosis.log_tail(ev.index.of_kind(diagnosis.LOG_KIND), stuck))
        return Finding(
            Outcome.FAIL,
            f"node {node} {where}: {stuck.line(ev.offset_s(stuck.since_wall_ns))}"
            f"{f'; its log ends: {said}' if said else ''}; it will not clear by itself "
            f"(called at +{ev.offset_s(stuck.terminal_wall_ns):.0f}s, not waiting out the "
            f"{budget})",
        ), None
    elapsed_s = ev.offset_s(ev.end_wall_ns())
    if elapsed_s >= settings.upgrade_budget_s:
        return Finding(
            Outcome.FAIL, f"node {node} {where} at +{elapsed_s:.0f}s, no upgrade-done within {budget}{held}"
        ), None
    return Finding(
        Outcome.INCONCLUSIVE,
        f"node {node} {where} when the recording ended at +{elapsed_s:.0f}s ({budget} not yet spent){held}",
    ), None


EVICTING_STATES = ("wait-for-jobs-required", op.POD_DELETION_REQUIRED, op.DRAIN_REQUIRED)


def how_upgraded(states: list[str]) -> str:
    """The path the operator took: v26.7+ restarts the driver pod in place when the change leaves the
    driver's configuration digest as it was (upgrade-required -> cordon-required -> pod-restart-required)."""
    if "pod-restart-required" in states and not set(EVICTING_STATES) & set(states):
        return "driver pod restarted in place (restart-only: no wait for jobs, pod deletion or drain)"
    return "full upgrade (with drain)" if op.DRAIN_REQUIRED in states else "full upgrade (pod deletion, no drain)"


def check_rollout(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    """Every pool node reached upgrade-done after upgrade-required, within the budget from upgrade start."""
    if not evidence.pool_nodes:
        return verdict(Stage.ROLLOUT, [Finding(Outcome.INCONCLUSIVE, "no pool nodes given")], [], "")
    findings, done_s, items, paths = [], [], [], []
    for node in evidence.pool_nodes:
        finding, seconds = _rollout_node(evidence, node, settings)
        findings.append(finding)
        done_s += [seconds] if seconds is not None else []
        cycle = evidence.index.upgrade_cycle(node, since_wall_ns=evidence.upgrade_started_wall_ns)
        items += _state_evidence(evidence, node, cycle)
        paths.append(how_upgraded([t.state for t in cycle]))
    items += [
        Evidence(
            r.received_wall_ns,
            evidence.offset_s(r.received_wall_ns),
            "ContainerLog",
            f"{r.namespace}/{r.name}/{r.object.get('container', '')}",
            line,
        )
        for r in evidence.index.of_kind(diagnosis.LOG_KIND)
        for line in r.object.get("lines") or []
    ]
    findings = [Finding(Outcome.FAIL, line) for line in evidence.blast_radius] + findings  # the headline when any
    metric_findings, metric_items = stage_metrics(evidence, Stage.ROLLOUT, settings)
    n = len(evidence.pool_nodes)
    pass_line = (
        f"{n}/{n} pool nodes reached upgrade-done, slowest at +{max(done_s or [0]):.0f}s <= budget "
        f"{settings.upgrade_budget_s:.0f} s (client receive time); {', '.join(sorted(set(paths)))}"
        f"{metrics_note(metric_findings)}"
    )
    return verdict(Stage.ROLLOUT, findings + metric_findings, items + metric_items, pass_line)
