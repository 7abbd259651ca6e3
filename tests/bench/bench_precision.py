"""P1: how precisely the canary measures queue delay and start latency, against the apiserver's audit log.

One `gpucanary run` on the fleet named by GPUCANARY_FLEET_DIR / GPUCANARY_FLEET_PORT_BASE (started if
down), then, for every probe Job of the run:
- as the canary reports it (reports/<run>/evidence.json): created = its client clock before the Job
  create call; scheduled / running = client receive time of the first watch event showing
  PodScheduled=True / phase Running (monotonic-aligned wall clock, ns);
- as the server saw it (audit log, requestReceivedTimestamp, 1 µs): the canary's `create jobs`, the
  scheduler's `create pods/binding` of the Job's pod, and the first pod status write whose body sets
  phase Running or Succeeded (the fleet logs pod status bodies).
Queue delay = scheduled - created (pool probes), start latency = running - created (fleet probes); the
error is the canary's figure minus the server's. Both clocks are this host's. Goal: p99 |error| <= 50 ms.

Run: python tests/bench/bench_precision.py [probe-interval-s]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from pytest_gpucanary.fleet import Fleet
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the test bed's helpers (testbed/)
from testbed.audit import read_log
from testbed.audit_run import run_canary
from pytest_gpucanary.ladder.model import summarize
from pytest_gpucanary.shipped import FIXTURES
import figures  # tests/bench/figures.py: this run's output, kept for the docs


def server_times(records: list, job: str) -> tuple[float | None, float | None, float | None]:
    """(Job created, pod bound, pod status first patched after binding), audit clock, Unix s."""
    created = next((r.received_s for r in records if r.resource == "jobs" and r.verb == "create" and r.name == job
                    and r.user_agent.startswith("gpucanary/")), None)
    bound = next((r for r in records if r.resource == "pods" and r.subresource == "binding"
                  and r.name.rsplit("-", 1)[0] == job), None)
    if bound is None:
        return created, None, None
    running = next((r.received_s for r in records if r.resource == "pods" and r.subresource == "status"
                    and r.name == bound.name and r.sets_phase in ("Running", "Succeeded")), None)
    return created, bound.received_s, running


def main(interval_s: str = "5") -> None:
    # KWOK pools, as the figures in docs/measurements.md were measured (the fleet's default pool is its kubelet node)
    os.environ.setdefault("GPUCANARY_FLEET_KUBELET_POOL", "0")
    fleet = Fleet.from_env()
    fleet.up(progress=lambda line: print(line, file=sys.stderr))
    reports = Path(tempfile.mkdtemp(prefix="gpucanary-precision-"))
    result = run_canary(fleet, [f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                                "--gpucanary-driver-version=580.95.05", f"--gpucanary-probe-interval-s={interval_s}",
                                "--gpucanary-max-p99-s=3"], reports=reports)
    evidence = json.loads((reports / result.run_id / "evidence.json").read_text())
    records = read_log(fleet.layout.audit_log, since_s=result.since_s, until_s=result.until_s + 60)
    errors_ms: dict[str, list[float]] = {"pool queue delay": [], "fleet start latency": []}
    for probe in evidence["probes"]:
        created, bound, running = server_times(records, probe["name"])
        end_ns, server_end = ((probe["scheduled_wall_ns"], bound) if probe["scope"] == "pool"
                              else (probe["running_wall_ns"], running))
        if created is None or server_end is None or end_ns is None:
            continue
        canary_s = (end_ns - probe["created_wall_ns"]) / 1e9
        errors_ms["pool queue delay" if probe["scope"] == "pool" else "fleet start latency"].append(
            1000 * (canary_s - (server_end - created)))
    print(f"run {result.run_id}: exit {result.returncode}, {len(evidence['probes'])} probes, "
          f"probe interval {interval_s} s")
    print(f"{'interval':<22}{'n':>4}{'p50 |err| ms':>14}{'p99 |err| ms':>14}{'max |err| ms':>14}{'mean err ms':>13}")
    for what, errors in errors_ms.items():
        stats = summarize([abs(e) for e in errors])
        if stats is None:
            print(f"{what:<22}{0:>4}   (no probe with both figures)")
            continue
        print(f"{what:<22}{stats.n:>4}{stats.p50_s:>14.1f}{stats.p99_s:>14.1f}{stats.max_s:>14.1f}"
              f"{sum(errors) / len(errors):>13.1f}")
    print("error = canary figure - audit figure; canary: client receive time of the watch event; "
          "audit: requestReceivedTimestamp (1 us); one host clock")


if __name__ == "__main__":
    with figures.recorded(__file__):
        main(*sys.argv[1:])
