"""`gpucanary evaluate` judges a recorded run again from its run directory alone: the Prometheus answers and
the load samples as recorded, cut and judged by the ladder with the thresholds given, to a different verdict
when a threshold changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpucanary.canary.outcome import judge
from pytest_gpucanary.cli import ExitCode, main
from pytest_gpucanary.config import Settings
from pytest_gpucanary.ladder import RunEvidence, UpgradePhase
from pytest_gpucanary.ladder.evidence import LOAD_FILE, TIMELINE_FILE
from pytest_gpucanary.ladder.model import MetricAnswer, Sample, Series
from canned_runs import NEW, NODE, at, clean_run


def answers(xid: float) -> tuple[MetricAnswer, ...]:
    return (
        MetricAnswer("no-upgrade-failed", "max(...)", "600s", (Series({}, 1.0, 0.0),)),
        MetricAnswer("no-xid-errors", "max by (...)", "600s", (Series({"Hostname": NODE, "gpu": "0"}, 1.0, xid),)),
        MetricAnswer("dcgm-driver-version", "max by (...)", "600s",
                     (Series({"Hostname": NODE, "DCGM_FI_DRIVER_VERSION": NEW}, 1.0, 2.0),)),
    )


def samples(slow_from_s: float, slow_to_s: float) -> tuple[Sample, ...]:
    """Ten requests a second from before the upgrade to after it; 2 s each in [slow_from_s, slow_to_s)."""
    return tuple(Sample(at(i / 10), 2.0 if slow_from_s <= i / 10 < slow_to_s else 0.01, True, 200)
                 for i in range(-300, 6000))


def recorded(tmp_path: Path, evidence: RunEvidence, settings: Settings) -> Path:
    """A run directory as a run leaves it: its timeline, its evidence, its load samples and its receipt."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TIMELINE_FILE).write_text("".join(r.to_json() + "\n" for r in evidence.records))
    evidence.write(run_dir)
    judge(evidence, settings, run_dir)
    return run_dir


def verdicts(run_dir: Path) -> dict[str, str]:
    return {v["stage"]: v["outcome"] for v in json.loads((run_dir / "receipt.json").read_text())["verdicts"]}


def test_an_allowed_xid_given_to_evaluate_turns_the_recorded_device_failure_into_a_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = recorded(tmp_path, clean_run(metric_answers=answers(xid=43)), Settings())
    assert verdicts(run_dir)["device"] == "fail"
    assert main(["evaluate", str(run_dir)]) == ExitCode.GATE_FAILED          # the run's own thresholds: same
    assert verdicts(run_dir)["device"] == "fail"
    assert main(["evaluate", str(run_dir), "--gpucanary-allowed-xids=13,43"]) == ExitCode.OK
    assert verdicts(run_dir)["device"] == "pass"
    assert json.loads((run_dir / "receipt.json").read_text())["thresholds"]["allowed_xids"] == "13,43"
    assert main(["evaluate", str(run_dir), "--gpucanary-allowed-xids=79"]) == ExitCode.GATE_FAILED


def test_evaluate_cuts_the_recorded_load_by_phase_again_and_judges_it_with_a_changed_p99(tmp_path: Path) -> None:
    # slow requests only while the pool node is in pod-restart-required (26 s to 90 s in clean_run)
    evidence = clean_run(load_samples=samples(30, 60))
    by_phase = {s.phase: s for s in evidence.service_phases}                 # cut from the samples, not recorded
    assert by_phase[UpgradePhase.RESTART].requests == 1090 and by_phase[UpgradePhase.RESTART].p99_s == 2.0
    assert by_phase[UpgradePhase.AFTER].p99_s == 0.01
    run_dir = recorded(tmp_path, evidence, Settings(max_p99_s=5.0))
    assert (run_dir / LOAD_FILE).read_text().count("\n") == 6300
    assert verdicts(run_dir)["application"] == "pass"
    stored = json.loads((run_dir / "evidence.json").read_text())
    stored["service_phases"] = []                                            # only the samples are read back
    (run_dir / "evidence.json").write_text(json.dumps(stored))
    assert main(["evaluate", str(run_dir)]) == ExitCode.OK
    assert main(["evaluate", str(run_dir), "--gpucanary-max-p99-s=1.5"]) == ExitCode.GATE_FAILED
    assert verdicts(run_dir)["application"] == "fail"
    assert RunEvidence.read(run_dir).service_phases == evidence.service_phases
