"""The ladder's judgement of the Prometheus checks: what the run recorded Prometheus answering (a
`MetricAnswer` per shipped check) judged against the pool, the target driver and the thresholds. Pure, so
`gpucanary evaluate` judges the same answers again with other thresholds.

An answer that is missing, an error or empty is INCONCLUSIVE with a one-line detail, never PASS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytest_gpucanary.ladder.model import MetricAnswer, MetricCheck, Outcome, Series, Stage

if TYPE_CHECKING:
    from pytest_gpucanary.config import Settings
    from pytest_gpucanary.ladder.evidence import RunEvidence

NODE_LABEL = "Hostname"  # dcgm-exporter's node label; relabelled setups may use another
DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"
STAGES = {"no-upgrade-failed": Stage.ROLLOUT, "no-xid-errors": Stage.DEVICE, "dcgm-driver-version": Stage.DEVICE}


def checks(evidence: RunEvidence, settings: Settings) -> tuple[MetricCheck, ...]:
    """Every recorded answer judged (evidence recorded before answers were kept carries its checks judged)."""
    if not evidence.metric_answers:
        return evidence.metric_checks
    return tuple(judge(answer, evidence, settings) for answer in evidence.metric_answers)


def judge(answer: MetricAnswer, evidence: RunEvidence, settings: Settings) -> MetricCheck:
    return judge_answer(
        answer, nodes=evidence.pool_nodes, target=evidence.driver_to, allowed_xids=settings.xids_allowed()
    )


def judge_answer(
    answer: MetricAnswer, *, nodes: Sequence[str], target: str, allowed_xids: frozenset[int] = frozenset()
) -> MetricCheck:
    stage = STAGES[answer.name]
    if answer.error:
        return MetricCheck(answer.name, stage, Outcome.INCONCLUSIVE, None, answer.error)
    if answer.name == "no-upgrade-failed":
        return judge_upgrade_failed(answer.series, span=answer.span)
    if answer.name == "no-xid-errors":
        return judge_xid(answer.series, nodes=nodes, span=answer.span, allowed=allowed_xids)
    return judge_driver_version(answer.series, nodes=nodes, target=target)


def judge_upgrade_failed(series: Sequence[Series], *, span: str) -> MetricCheck:
    name, what = "no-upgrade-failed", "max(gpu_operator_nodes_upgrades_failed)"
    if not series:
        return MetricCheck(
            name,
            Stage.ROLLOUT,
            Outcome.INCONCLUSIVE,
            None,
            f"no {what} samples over the last {span} (is the GPU Operator scraped?)",
        )
    worst = max(s.value for s in series)
    outcome = Outcome.PASS if worst == 0 else Outcome.FAIL
    return MetricCheck(name, Stage.ROLLOUT, outcome, worst, f"{what} over the run ({span}) = {worst:g}, expected 0")


def judge_xid(
    series: Sequence[Series],
    *,
    nodes: Sequence[str],
    span: str,
    node_label: str = NODE_LABEL,
    allowed: frozenset[int] = frozenset(),
) -> MetricCheck:
    """DCGM_FI_DEV_XID_ERRORS is the last XID a GPU reported; an `allowed` code (one an application causes)
    does not fail the check."""
    name = "no-xid-errors"
    if not nodes:
        return MetricCheck(name, Stage.DEVICE, Outcome.INCONCLUSIVE, None, "no pool nodes given")
    missing = sorted(set(nodes) - {s.labels.get(node_label, "") for s in series})
    bad = sorted((s for s in series if s.value != 0 and s.value not in allowed), key=lambda s: -s.value)
    if bad:
        s = bad[0]
        return MetricCheck(
            name,
            Stage.DEVICE,
            Outcome.FAIL,
            s.value,
            f"{s.labels.get(node_label, '?')} GPU {s.labels.get('gpu', '?')} reported XID {s.value:g} "
            f"within {span} ({len(bad)} GPU(s) with XIDs), expected none",
        )
    if missing:
        return MetricCheck(
            name,
            Stage.DEVICE,
            Outcome.INCONCLUSIVE,
            None,
            f"no DCGM_FI_DEV_XID_ERRORS samples within {span} for {', '.join(missing)}",
        )
    return MetricCheck(
        name,
        Stage.DEVICE,
        Outcome.PASS,
        0.0,
        f"max DCGM_FI_DEV_XID_ERRORS over {span} = 0 on {len(nodes)} node(s), {len(series)} GPU(s)"
        + (f" (allowed XIDs {', '.join(map(str, sorted(allowed)))} not counted)" if allowed else ""),
    )


def latest_versions(series: Sequence[Series], *, node_label: str = NODE_LABEL) -> dict[str, str]:
    """Per node, the driver version label of its newest sample (value = sample time)."""
    newest: dict[str, Series] = {}
    for s in series:
        node = s.labels.get(node_label, "")
        if node not in newest or s.value > newest[node].value:
            newest[node] = s
    return {node: s.labels.get(DRIVER_LABEL, "") for node, s in newest.items()}


def judge_driver_version(
    series: Sequence[Series], *, nodes: Sequence[str], target: str, node_label: str = NODE_LABEL
) -> MetricCheck:
    name = "dcgm-driver-version"
    if not nodes:
        return MetricCheck(name, Stage.DEVICE, Outcome.INCONCLUSIVE, None, "no pool nodes given")
    versions = latest_versions(series, node_label=node_label)
    wrong = sorted(f"{n} reports {versions[n]}" for n in nodes if versions.get(n) and versions[n] != target)
    at_target = sum(versions.get(n) == target for n in nodes)
    if wrong:
        return MetricCheck(
            name, Stage.DEVICE, Outcome.FAIL, float(at_target), f"{'; '.join(wrong)}; expected {DRIVER_LABEL}={target}"
        )
    unknown = sorted(n for n in nodes if not versions.get(n))
    if unknown:
        return MetricCheck(
            name,
            Stage.DEVICE,
            Outcome.INCONCLUSIVE,
            None,
            f"no DCGM series with a {DRIVER_LABEL} label for {', '.join(unknown)}",
        )
    return MetricCheck(
        name,
        Stage.DEVICE,
        Outcome.PASS,
        float(at_target),
        f"{at_target}/{len(nodes)} node(s) report {DRIVER_LABEL}={target}",
    )
