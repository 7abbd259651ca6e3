"""Network: a multi-node collective probe; skipped, with the reason, on a one-node pool. Pure."""

from __future__ import annotations

from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.model import Outcome, Stage, StageVerdict
from pytest_gpucanary.ladder.rules import Finding, stage_metrics, verdict

ONE_NODE_REASON = "one-node pool: no multi-node collective probe possible"


def check_network(evidence: RunEvidence, settings: Settings = DEFAULTS) -> StageVerdict:
    """A multi-node collective probe (reported as NETWORK metric checks); skipped, with the reason, on one node."""
    n = len(evidence.pool_nodes)
    if n == 1:
        return StageVerdict(Stage.NETWORK, Outcome.SKIPPED, f"{Stage.NETWORK.value}: {ONE_NODE_REASON}")
    findings, items = stage_metrics(evidence, Stage.NETWORK)
    if not findings:
        findings = [Finding(Outcome.INCONCLUSIVE, f"no multi-node collective probe result for the {n}-node pool (n=0)")]
    return verdict(Stage.NETWORK, findings, items, f"{len(findings)} collective probe check(s) passed on {n} nodes")
