"""The e2e version matrix: the upgrade, ClusterPolicy-mode and fleet smoke tests on each GPU Operator
release, each on a fleet of that release, one release after the other.

Usage: python tests/bench/release_matrix.py OUT_DIR RELEASE... [-- PYTEST_ARGS]
Per release, under OUT_DIR/<release>/: the session fleet's state (fleet/), pytest's --basetemp (tmp/,
where the upgrade tests and canary runs leave their timeline.jsonl), junit.xml and pytest.log. At the
end it prints, per release, the outcome counts from the JUnit file, the wall time of its pytest run
(monotonic clock) and the time spent in each upgrade state over every timeline of that release
(upgrade_transitions.py). Exit 1 when any release had a failed, errored or skipped test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import upgrade_transitions
import figures  # tests/bench/figures.py: this run's output, kept for the docs

MODULES = ("tests/fleet/test_operator_upgrades.py", "tests/canary/test_clusterpolicy_mode.py",
           "tests/fleet/test_fleet_releases.py")


@dataclass(frozen=True)
class ReleaseRun:
    release: str
    wall_s: float
    outcomes: dict[str, int]
    per_state: dict[str, list[float]]


def outcomes(junit: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    if not junit.exists():
        return counts
    for case in ET.parse(junit).iter("testcase"):
        tags = {child.tag for child in case}
        kind = next((k for k in ("failure", "error", "skipped") if k in tags), None)
        counts[{"failure": "failed", None: "passed"}.get(kind, kind)] += 1
    return counts


def run_release(out: Path, release: str, pytest_args: list[str]) -> ReleaseRun:
    here = out / release
    here.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GPUCANARY_OPERATOR_RELEASE": release, "GPUCANARY_FLEET_DIR": str(here / "fleet")}
    command = [sys.executable, "-m", "pytest", *MODULES, f"--basetemp={here / 'tmp'}",
               f"--junitxml={here / 'junit.xml'}", "-rfEs", *pytest_args]
    print(f"release-matrix: {release}: {' '.join(command)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    with open(here / "pytest.log", "w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall_s = time.monotonic() - start
    timelines = sorted((here / "tmp").rglob("timeline.jsonl"))
    return ReleaseRun(release, wall_s, outcomes(here / "junit.xml"), upgrade_transitions.collect(timelines))


def report(runs: list[ReleaseRun]) -> None:
    for r in runs:
        counts = ", ".join(f"{n} {k}" for k, n in r.outcomes.items() if n)
        print(f"\n## {r.release}: {counts or 'no tests ran'}; wall {r.wall_s // 60:.0f} min {r.wall_s % 60:.0f} s")
        print(upgrade_transitions.table(r.per_state) if r.per_state else "no upgrade cycle recorded")


def main(argv: list[str]) -> int:
    args, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if len(args) < 2:
        print(__doc__.split("\n\n")[1].splitlines()[0], file=sys.stderr)
        return 4
    out = Path(args[0]).resolve()
    runs = []
    for release in args[1:]:
        runs.append(run_release(out, release, pytest_args))
        r = runs[-1]
        print(f"release-matrix: {release} done in {r.wall_s:.0f} s: {r.outcomes}", file=sys.stderr, flush=True)
    report(runs)
    bad = [r for r in runs if r.outcomes["failed"] or r.outcomes["error"] or r.outcomes["skipped"]
           or not r.outcomes["passed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    with figures.recorded(__file__):
        sys.exit(main(sys.argv[1:]))
