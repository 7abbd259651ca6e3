"""A run's outcome: its evidence, the ladder's judgement and the receipt; and judging a recorded run again.

`judge` is what a run does at its end; `replay` (`gpucanary evaluate`) does the same, offline, from
what the run wrote (evidence.json, timeline.jsonl, load.jsonl): judging is a pure function of the record.
Never touches a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpucanary import ladder
from pytest_gpucanary.config import DEFAULTS, Settings
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.ladder import LadderResult, RunEvidence, Stage, StageVerdict
from pytest_gpucanary.ladder.model import fails_gate
from pytest_gpucanary.receipt import FILES, write_receipt


@dataclass(frozen=True)
class RunOutcome:
    """One run's evidence, the ladder's judgement of it, and where the receipt was written."""

    evidence: RunEvidence
    result: LadderResult
    settings: Settings
    report_dir: Path
    receipt: Mapping[str, str] = field(default_factory=dict)

    def verdict(self, stage: Stage | str) -> StageVerdict:
        return self.result.verdict(stage)

    def fails_gate(self, verdict: StageVerdict) -> bool:
        return fails_gate(verdict.outcome, self.settings)


def judge(evidence: RunEvidence, settings: Settings, report_dir: Path) -> RunOutcome:
    """Judge the evidence and write the receipt: what a run does at its end, and `gpucanary evaluate` again."""
    result = ladder.evaluate(evidence, settings)
    paths = write_receipt(report_dir, result, evidence)
    return RunOutcome(evidence, result, settings, report_dir, {kind: str(path) for kind, path in paths.items()})


def replay(report_dir: Path, overrides: Mapping[str, Any]) -> RunOutcome:
    """Judge a recorded run again, offline, with the thresholds it was judged with unless overridden, and
    rewrite its receipt: judging is a pure function of what the run wrote."""
    try:
        evidence = RunEvidence.read(report_dir)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{report_dir} holds no readable recorded run ({type(err).__name__}: {str(err)[:120]})",
            hint="give a reports/<run-id> directory that a canary run wrote",
        ) from None
    recorded = evidence.thresholds or _receipt_thresholds(report_dir)
    return judge(evidence, DEFAULTS.with_thresholds({**recorded, **overrides}), report_dir)


def _receipt_thresholds(report_dir: Path) -> Mapping[str, Any]:
    """What a run recorded before its evidence kept its thresholds was judged with, from its receipt."""
    try:
        return json.loads((report_dir / FILES["json"]).read_text(encoding="utf-8"))["thresholds"]
    except (OSError, ValueError, KeyError):
        return {}  # the run ended before its receipt: judge with the defaults
