"""The JSON receipt: the gate, the run, the thresholds, every verdict with its evidence, and what the
ladder computed (evictions, phase windows, state spans, GPU capacity and stalls per node) and the collective
probe's runs. `parse_json` reads it back."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pytest_gpucanary.ladder import Eviction, Evidence, LadderResult, Outcome, RunEvidence, Stage, StageVerdict
from pytest_gpucanary.ladder.cause import Cause
from pytest_gpucanary.ladder.model import CapacityDip, PhaseWindow, StateSpan
from pytest_gpucanary.receipt.common import neighbour_acts, utc

SCHEMA = "gpucanary-receipt/1"


def render_json(result: LadderResult, evidence: RunEvidence) -> str:
    document = {
        "schema": SCHEMA,
        "gate_passed": result.gate_passed,
        "first_failed": result.first_failed.value if result.first_failed else None,
        "run": {
            "run_id": evidence.run_id,
            "pool_nodes": list(evidence.pool_nodes),
            "driver_from": evidence.driver_from,
            "driver_to": evidence.driver_to,
            "policy_path": evidence.policy_path,
            "gpu_job": dataclasses.asdict(evidence.gpu_job),
            "started_wall_ns": evidence.upgrade_started_wall_ns,
            "finished_wall_ns": evidence.finished_wall_ns,
            "started_utc": utc(evidence.upgrade_started_wall_ns),
            "finished_utc": utc(evidence.finished_wall_ns),
            "ci": dict(evidence.ci),
            "exposure": list(evidence.exposure),
            "pool_setup": list(evidence.pool_setup),
            "unproven": list(evidence.unproven),
            "held_nodes": list(evidence.held_nodes),
            "operator_release": evidence.operator_release,
            "policy_applied_to": evidence.policy_applied_to,
            "upgrade_policy": dict(evidence.upgrade_policy),
            "policy_rendering": list(evidence.policy_rendering),
            "neighbours": [
                {**dataclasses.asdict(a), "offset_s": evidence.offset_s(a.wall_ns)} for a in neighbour_acts(evidence)
            ],
        },
        "thresholds": dict(result.thresholds),
        "verdicts": [
            {
                "stage": v.stage.value,
                "outcome": v.outcome.value,
                "summary": v.summary,
                "evidence": [dataclasses.asdict(e) for e in v.evidence],
            }
            for v in result.verdicts
        ],
        "evictions": [dataclasses.asdict(e) for e in result.evictions],
        "phase_windows": [dataclasses.asdict(w) for w in result.phase_windows],
        "state_spans": [dataclasses.asdict(s) for s in result.state_spans],
        "capacity": [{**dataclasses.asdict(c), "gone_s": c.gone_s} for c in result.capacity],
        "stalls": [dataclasses.asdict(c) for c in result.stalls],
        "collective": {
            "note": evidence.collective_note,
            "runs": [
                {**dataclasses.asdict(c), "took_s": c.took_s, "started_offset_s": evidence.offset_s(c.started_wall_ns)}
                for c in evidence.collective
            ],
        },
    }
    return json.dumps(document, indent=1, default=str) + "\n"


def parse_json(text: str) -> LadderResult:
    """Read a receipt's judgement back (for gates that compare runs); inverse of `render_json`."""
    document: dict[str, Any] = json.loads(text)
    verdicts = tuple(
        StageVerdict(
            Stage(s["stage"]), Outcome(s["outcome"]), s["summary"], tuple(Evidence(**e) for e in s["evidence"])
        )
        for s in document["verdicts"]
    )
    first = document["first_failed"]
    return LadderResult(
        verdicts,
        Stage(first) if first else None,
        document["gate_passed"],
        document["thresholds"],
        tuple(Eviction(**e) for e in document["evictions"]),
        tuple(PhaseWindow(**w) for w in document["phase_windows"]),
        tuple(StateSpan(**s) for s in document["state_spans"]),
        tuple(
            CapacityDip(
                **{
                    **{k: v for k, v in c.items() if k != "gone_s"},
                    "series": tuple(tuple(point) for point in c["series"]),
                }
            )
            for c in document.get("capacity", [])
        ),
        stalls=tuple(Cause(**c) for c in document.get("stalls", [])),
    )
