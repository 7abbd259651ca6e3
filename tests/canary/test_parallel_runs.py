"""Two pipelines canary the same cluster at once, each with its own pool, and each follows its run with
the always-run `gpucanary cleanup` without a run id: neither cleanup may touch the other's live run.

On operator v26.7 (the fleet's default) each NVIDIADriver carries its own upgradePolicy, so the two
runs' policies never meet; what would meet is the cleanup, which is what this proves.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
from harness import CLI, FAST, TARGET, gpucanary, unbuffered

from pytest_gpucanary.canary.apply import SAVED_SPEC_ANNOTATION
from pytest_gpucanary.cluster import discover
from pytest_gpucanary.gpu_operator import NVIDIADRIVER
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.shipped import FIXTURES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARGS = [f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}", f"--gpucanary-driver-version={TARGET}",
        *FAST, "--gpucanary-load-users=4"]


class Run:
    """One `gpucanary run` in the background, its output collected, a line awaited."""

    def __init__(self, run_id: str, reports: Path, *extra: str) -> None:
        self.run_id = run_id
        self.proc = subprocess.Popen([*CLI, "run", *ARGS, *extra,
                                      f"--gpucanary-run-id={run_id}", f"--gpucanary-reports-dir={reports}"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=unbuffered())
        self.lines: list[str] = []
        self.applied = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "applied; upgrading the pool" in line:
                self.applied.set()

    def finish(self, timeout_s: float = 900) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def cleanup(kube_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return gpucanary("cleanup", base=kube_env, unbuffered=False, timeout_s=300)


def owned_by(kube: Kube, run_id: str) -> dict[str, list[str]]:
    """What a run has on the cluster right now: its pool nodes, its NVIDIADriver with a saved spec, its namespaces."""
    selector = f"gpucanary.io/run-id={run_id}"
    live = [o for o in kube.list("v1", "Namespace", label_selector=selector) if not o["metadata"].get("deletionTimestamp")]
    return {"nodes": [n["metadata"]["name"] for n in kube.list("v1", "Node", label_selector=selector)],
            "namespaces": sorted(o["metadata"]["name"] for o in live),
            "saved": [d["metadata"]["name"] for d in kube.list(*NVIDIADRIVER, label_selector=selector)
                      if SAVED_SPEC_ANNOTATION in d["metadata"].get("annotations", {})]}


def test_two_parallel_runs_each_followed_by_cleanup_leave_the_other_intact(gpucanary_fleet, kube: Kube,
                                                                         tmp_path: Path) -> None:
    assert discover(kube).per_driver_policy, "two runs at once need per-NVIDIADriver policies (operator v26.7+)"
    first = Run("par-first", tmp_path / "reports")
    assert first.applied.wait(timeout=300), first.output[-3000:]
    # starts while the first one upgrades its pool; its longer GPU job keeps it live (waiting for the job)
    # well past the first run's end and cleanup, however slow the machine
    second = Run("par-second", tmp_path / "reports", "--gpucanary-job-duration-s=300")
    assert second.applied.wait(timeout=300), second.output[-3000:]

    assert first.finish() == 0, first.output[-3000:]
    during = owned_by(kube, second.run_id)
    assert during["nodes"] and during["saved"] and f"gpucanary-{second.run_id}-owner" in during["namespaces"], (
        during, second.proc.poll(), second.output[-2000:])
    swept = cleanup(unbuffered())                                  # the first pipeline's always-run cleanup step
    assert swept.returncode == 0, swept.stderr
    assert f"left live run {second.run_id} alone" in swept.stderr, swept.stderr
    assert owned_by(kube, second.run_id) == during       # the live run kept everything

    assert second.finish() == 0, second.output[-3000:]
    assert cleanup(unbuffered()).returncode == 0
    for run in (first, second):
        assert owned_by(kube, run.run_id) == {"nodes": [], "namespaces": [], "saved": []}, run.run_id
