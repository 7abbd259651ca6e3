"""A finished run's verdict, in the shapes other tools read: the data of a ConfigMap, and Prometheus metrics.

A verdict is keyed by exactly what the run proved: the digest of the upgrade policy as applied (its CR
form, so a Helm values file and the ClusterPolicy it renders are one policy), the target driver and the
GPU Operator release. `pytest_gpucanary.canary.publish` keeps it in the cluster and pushes the metrics.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_gpucanary.ladder import LadderResult, RunEvidence
from pytest_gpucanary.receipt.common import utc

METRICS_FILE = "verdict.prom"
CONFIGMAP_PREFIX = "gpucanary-verdict-"


def policy_digest(upgrade_policy: Mapping[str, Any]) -> str:
    canonical = json.dumps(upgrade_policy, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class VerdictKey:
    policy_digest: str
    target: str
    release: str  # "" when the ClusterPolicy names none

    @classmethod
    def of(cls, upgrade_policy: Mapping[str, Any], target: str, release: str | None) -> VerdictKey:
        return cls(policy_digest(upgrade_policy), target, release or "")

    @property
    def name(self) -> str:
        """The ConfigMap's name: one per key, so a later run for the same key replaces the earlier verdict."""
        text = "\n".join((self.policy_digest, self.target, self.release))
        return CONFIGMAP_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:20]

    def labels(self) -> dict[str, str]:
        return {"policy_digest": self.policy_digest, "target": self.target, "release": self.release}

    def describe(self) -> str:
        return (
            f"policy {self.policy_digest[:19]}, driver {self.target}, "
            f"GPU Operator {self.release or '(release unknown)'}"
        )


@dataclass(frozen=True)
class Verdict:
    key: VerdictKey
    passed: bool
    run_id: str
    finished_wall_ns: int
    first_failed: str  # "" when the gate passed
    stages: Mapping[str, str]  # stage -> outcome, in ladder order
    policy_path: str = ""
    pool_nodes: tuple[str, ...] = ()

    @classmethod
    def of(cls, result: LadderResult, evidence: RunEvidence) -> Verdict:
        return cls(
            VerdictKey.of(evidence.upgrade_policy, evidence.driver_to, evidence.operator_release),
            result.gate_passed,
            evidence.run_id,
            evidence.finished_wall_ns,
            result.first_failed.value if result.first_failed else "",
            {v.stage.value: v.outcome.value for v in result.verdicts},
            evidence.policy_path,
            tuple(evidence.pool_nodes),
        )

    def data(self) -> dict[str, str]:
        """The ConfigMap's data: plain strings a `kubectl get -o jsonpath` can read."""
        return {
            "policy-digest": self.key.policy_digest,
            "target": self.key.target,
            "release": self.key.release,
            "passed": "true" if self.passed else "false",
            "first-failed": self.first_failed,
            "run-id": self.run_id,
            "finished": utc(self.finished_wall_ns),
            "finished-wall-ns": str(self.finished_wall_ns),
            "stages": json.dumps(dict(self.stages)),
            "policy-path": self.policy_path,
            "pool-nodes": ",".join(self.pool_nodes),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, str]) -> Verdict:
        """Inverse of `data`; ValueError or KeyError when it is not one."""
        return cls(
            VerdictKey(data["policy-digest"], data["target"], data["release"]),
            data["passed"] == "true",
            data["run-id"],
            int(data["finished-wall-ns"]),
            data.get("first-failed", ""),
            dict(json.loads(data["stages"])),
            data.get("policy-path", ""),
            tuple(n for n in data.get("pool-nodes", "").split(",") if n),
        )

    def line(self) -> str:
        gate = "passed" if self.passed else f"failed at {self.first_failed or 'an unknown stage'}"
        return f"run {self.run_id} {gate} at {utc(self.finished_wall_ns)} for {self.key.describe()}"

    def exposition(self) -> str:
        """Prometheus text format: for a node exporter's textfile collector, or a Pushgateway."""
        key = _labels(self.key.labels())
        lines = [
            "# HELP gpucanary_verdict_passed Whether the last finished canary run for this policy, target driver and "
            "GPU Operator release passed the gate.",
            "# TYPE gpucanary_verdict_passed gauge",
            f"gpucanary_verdict_passed{{{key}}} {int(self.passed)}",
            "# HELP gpucanary_verdict_finished_timestamp_seconds When that run finished, in Unix time.",
            "# TYPE gpucanary_verdict_finished_timestamp_seconds gauge",
            f"gpucanary_verdict_finished_timestamp_seconds{{{key}}} {self.finished_wall_ns / 1e9:.3f}",
            "# HELP gpucanary_verdict_stage Each ladder stage's outcome in that run (1 on the outcome it had).",
            "# TYPE gpucanary_verdict_stage gauge",
            *(
                f"gpucanary_verdict_stage{{{key},{_labels({'stage': stage, 'outcome': outcome})}}} 1"
                for stage, outcome in self.stages.items()
            ),
            "# HELP gpucanary_verdict_info The run that gave the verdict.",
            "# TYPE gpucanary_verdict_info gauge",
            f"gpucanary_verdict_info{{{key},{_labels({'run_id': self.run_id})}}} 1",
        ]
        return "\n".join(lines) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    def escaped(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return ",".join(f'{name}="{escaped(value)}"' for name, value in labels.items())


def render_metrics(result: LadderResult, evidence: RunEvidence) -> str:
    return Verdict.of(result, evidence).exposition()
