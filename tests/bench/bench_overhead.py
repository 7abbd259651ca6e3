"""P4: a canary run's wall time beyond the pool's own upgrade, split by step.

Reads what runs wrote: reports/<run>/steps.json (each step's wall time, monotonic clock) and
evidence.json + timeline.jsonl (the pool node's upgrade, client receive times). Overhead = the run's
wall time - the upgrade (upgrade-required to upgrade-done/failed) - the baseline window; goal <= 30 s.

Run: python tests/bench/bench_overhead.py reports/<run-id> [...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.timeline import upgrade_cycle
import figures  # tests/bench/figures.py: this run's output, kept for the docs

STEPS = ("preflight", "pool", "workloads", "baseline", "upgrade", "settle", "evaluate", "restore")


def upgrade_s(evidence: RunEvidence) -> float | None:
    node = evidence.pool_nodes[0]
    cycle = upgrade_cycle(evidence.records, node, since_wall_ns=evidence.upgrade_started_wall_ns)
    end = next((t for t in cycle if t.state in ("upgrade-done", "upgrade-failed")), None)
    return None if not cycle or end is None else (end.received_wall_ns - cycle[0].received_wall_ns) / 1e9


def main(dirs: list[str]) -> None:
    print(f"{'run':<28}" + "".join(f"{s:>10}" for s in STEPS) + f"{'total':>9}{'upgrade':>9}{'overhead':>10}")
    for raw in dirs:
        report = Path(raw)
        steps = json.loads((report / "steps.json").read_text())["seconds"]
        evidence = RunEvidence.read(report)
        total, upgrade = sum(steps.values()), upgrade_s(evidence)
        overhead = None if upgrade is None else total - upgrade - steps.get("baseline", 0.0)
        print(f"{report.name:<28}" + "".join(f"{steps.get(s, 0.0):>10.1f}" for s in STEPS) + f"{total:>9.1f}"
              + (f"{upgrade:>9.1f}{overhead:>10.1f}" if upgrade is not None else f"{'-':>9}{'-':>10}"))
    print("seconds; steps on the monotonic clock, the upgrade on client receive times of the Node watch; "
          "overhead = total - upgrade - baseline (goal <= 30 s)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} REPORT_DIR [...]: a run's directory, e.g. reports/<run-id>")  # records nothing
    with figures.recorded(__file__):
        main(sys.argv[1:])
