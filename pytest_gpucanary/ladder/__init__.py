"""The launch ladder: rollout -> device -> network -> scheduler -> application, one verdict per stage.

Pure: `evaluate(evidence, settings)` judges one run's evidence with the thresholds in `settings` and
returns the verdicts, the gate, and what it computed on the way (evictions, phase windows, state
spans) for the receipt to draw. Never talks to a cluster, never imports pytest, kube or kubernetes.
Missing evidence is inconclusive, never pass.
"""

from __future__ import annotations

from collections.abc import Callable

from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.ladder.application import check_application, evictions
from pytest_gpucanary.ladder.device import capacity_dips, check_device
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import (
    CapacityDip,
    Eviction,
    Evidence,
    LadderResult,
    MetricCheck,
    Outcome,
    PhaseStats,
    ProbeScope,
    ProbeSeen,
    RatePoint,
    Stage,
    StageVerdict,
    UpgradePhase,
    WorkloadRef,
    decide,
    summarize,
)
from pytest_gpucanary.ladder.network import check_network
from pytest_gpucanary.ladder.rollout import check_rollout, stall_of
from pytest_gpucanary.ladder.scheduler import check_scheduler

__all__ = [
    "CHECKS",
    "CapacityDip",
    "Evidence",
    "Eviction",
    "LadderResult",
    "MetricCheck",
    "Outcome",
    "PhaseStats",
    "ProbeScope",
    "ProbeSeen",
    "RatePoint",
    "RunEvidence",
    "Stage",
    "StageVerdict",
    "UpgradePhase",
    "WorkloadRef",
    "decide",
    "evaluate",
    "evictions",
    "summarize",
]

CHECKS: dict[Stage, Callable[[RunEvidence, Settings], StageVerdict]] = {
    Stage.ROLLOUT: check_rollout,
    Stage.DEVICE: check_device,
    Stage.NETWORK: check_network,
    Stage.SCHEDULER: check_scheduler,
    Stage.APPLICATION: check_application,
}


def evaluate(evidence: RunEvidence, settings: Settings = DEFAULTS) -> LadderResult:
    """Every stage in ladder order, then the gate."""
    verdicts = [CHECKS[stage](evidence, settings) for stage in Stage]
    first_node = evidence.pool_nodes[0] if evidence.pool_nodes else ""
    return decide(
        verdicts,
        settings,
        evictions=tuple(evictions(evidence, settings)),
        phase_windows=tuple(evidence.index.phase_windows(first_node, since_wall_ns=evidence.upgrade_started_wall_ns)),
        state_spans=tuple(span for node in evidence.pool_nodes for span in evidence.index.state_spans(node)),
        capacity=capacity_dips(evidence),
        stalls=tuple(c for node in evidence.pool_nodes if (c := stall_of(evidence, node, settings)) is not None),
    )
