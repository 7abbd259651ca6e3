"""What every receipt format shows the same way: the headline, the run's rows, times and offsets."""

from __future__ import annotations

from datetime import UTC, datetime

from pytest_gpucanary.ladder import Evidence, LadderResult, RunEvidence, neighbours
from pytest_gpucanary.ladder.neighbours import NeighbourAct


def utc(wall_ns: int | None) -> str:
    if wall_ns is None:
        return "-"
    return datetime.fromtimestamp(wall_ns / 1e9, tz=UTC).isoformat(timespec="seconds")


def headline(result: LadderResult) -> str:
    if result.gate_passed:
        return "Gate PASSED: wider rollout may proceed"
    assert result.first_failed is not None  # a failed gate names its first failed stage
    return f"Gate FAILED at stage {result.first_failed.value}: do not roll out wider"


def offset(evidence: Evidence) -> str:
    return "" if evidence.offset_s is None else f"{evidence.offset_s:+.1f} s"


def run_rows(ev: RunEvidence) -> list[tuple[str, str]]:
    ci = ", ".join(f"{k}={v}" for k, v in ev.ci.items()) or "not in CI"
    return [
        ("run id", ev.run_id),
        ("pool", ", ".join(ev.pool_nodes)),
        *(("pool setup", line) for line in ev.pool_setup),
        ("driver", f"{ev.driver_from} -> {ev.driver_to}"),
        ("upgrade policy", ev.policy_path),
        ("GPU Operator", ev.operator_release or "release unknown (no app.kubernetes.io/version label)"),
        ("applied to", ev.policy_applied_to or "-"),
        *(("policy render", line) for line in ev.policy_rendering),
        ("GPU job", f"{ev.gpu_job.name} (uid {ev.gpu_job.uid or 'unknown'})"),
        ("started", utc(ev.upgrade_started_wall_ns)),
        ("finished", utc(ev.finished_wall_ns)),
        ("CI", ci),
        *(("exposure", line) for line in ev.exposure),
        *(("not proven", line) for line in ev.unproven),
        *(("others on the pool", f"{ev.offset_s(act.wall_ns):+.1f} s {act.line()}") for act in neighbour_acts(ev)),
    ]


def neighbour_acts(ev: RunEvidence) -> list[NeighbourAct]:
    """What systems other than the upgrade and the canary did to the pool during the run (cordons, taints,
    NodeMaintenances): not judged, but a reader must know the pool was not the policy's alone."""
    return neighbours.neighbour_acts(ev.records, ev.pool_nodes)
