"""How soon a failing run says why: from the moment a stall became terminal to the gate's verdict.

Reads what failing runs wrote (reports/<run>/steps.json, evidence.json, timeline.jsonl). Per run: the
cause the rollout rung names (its class; upgrade-failed when the operator ended it first, e.g. a drain that
a PodDisruptionBudget refused until its timeout), when the kubelet first reported it, when it became terminal
(a record that shows it will not clear by itself, or the time it has held), when the verdict was there
(the end of the evaluate step: the upgrade step's start + upgrade + settle + evaluate), and the run's
total wall time. Goals: verdict within 60 s of terminal; a failing run on the kubelet pool under 6 minutes.

Failing runs to read: the kubelet pool's e2e (`tests/canary/test_kubelet_pool.py`, its runs of 999.1.1, the
driver-in-use case and 574.0.2's hang land under pytest's basetemp, failing-runs*/), or any `gpucanary run` with
--gpucanary-reports-dir. Run: python tests/bench/bench_rollout_diagnosis.py <reports>/<run-id> [...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pytest_gpucanary.config import DEFAULTS
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.rollout import stall_of
from pytest_gpucanary.ladder.timeline import upgrade_cycle
from pytest_gpucanary.receipt import FILES
import figures  # tests/bench/figures.py: this run's output, kept for the docs

BEFORE_UPGRADE = ("preflight", "pool", "workloads", "baseline")


def main(dirs: list[str]) -> None:
    print(f"{'run':<28}{'class':<18}{'seen':>7}{'terminal':>9}{'verdict':>9}{'to verdict':>11}{'total':>8}")
    for raw in dirs:
        report = Path(raw)
        steps = json.loads((report / "steps.json").read_text())["seconds"]
        evidence = RunEvidence.read(report)
        settings = DEFAULTS.with_thresholds(json.loads((report / FILES["json"]).read_text())["thresholds"])
        cause = next((c for n in evidence.pool_nodes if (c := stall_of(evidence, n, settings)) is not None), None)
        total = sum(steps.values())
        verdict_s = sum(steps.get(s, 0.0) for s in ("upgrade", "settle", "evaluate"))
        if cause is None or cause.terminal_wall_ns is None:     # the operator's own end: upgrade-failed
            failed = [t for n in evidence.pool_nodes for t in upgrade_cycle(
                evidence.records, n, since_wall_ns=evidence.upgrade_started_wall_ns) if t.state == "upgrade-failed"]
            if not failed:
                print(f"{report.name:<28}{'(no stall)':<18}{'':>7}{'':>9}{'':>9}{'':>11}{total:>8.1f}")
                continue
            terminal_s = evidence.offset_s(failed[0].received_wall_ns)
            print(f"{report.name:<28}{'upgrade-failed':<18}{'':>7}{terminal_s:>+9.0f}{verdict_s:>+9.0f}"
                  f"{verdict_s - terminal_s:>11.1f}{total:>8.1f}")
            continue
        seen_s, terminal_s = evidence.offset_s(cause.since_wall_ns), evidence.offset_s(cause.terminal_wall_ns)
        print(f"{report.name:<28}{cause.reason:<18}{seen_s:>+7.0f}{terminal_s:>+9.0f}{verdict_s:>+9.0f}"
              f"{verdict_s - terminal_s:>11.1f}{total:>8.1f}")
    print("seconds from the upgrade start (client receive times; the verdict from the steps' monotonic clock); "
          "goals: to verdict <= 60 s, total < 360 s on the kubelet pool")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} REPORT_DIR [...]: failing runs' directories")  # records nothing
    with figures.recorded(__file__):
        main(sys.argv[1:])
