"""`gpucanary gate` end to end on the local fleet: base and head of a policy change canaried at once.

The fleet runs GPU Operator v26.7.0 in NVIDIADriver mode, where each run's NVIDIADriver carries its
own upgradePolicy and each run makes its own KWOK pool, so the gate runs both in parallel. Both
directions run in one test to save CI time: default -> field-note fails naming the non-GPU eviction
head adds; field-note -> default passes. The HTML receipt is loaded in headless Chromium.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pytest_gpucanary.kube import Kube
from pytest_gpucanary.shipped import FIXTURES
from harness import FAST, KEEP_FLEET, TARGET, assert_nothing_left, gpucanary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLICIES = FIXTURES / "policies"


def gate(base: Path, head: Path, reports: Path, gate_id: str) -> subprocess.CompletedProcess[str]:
    return gpucanary("gate", "--base", str(base), "--head", str(head), f"--gpucanary-driver-version={TARGET}", *FAST,
                     f"--gpucanary-run-id={gate_id}", f"--gpucanary-reports-dir={reports}", env=KEEP_FLEET,
                     timeout_s=1500)


def chromium_dom(page: Path, tmp_path: Path) -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "chromium is missing: apt-get install -y chromium"
    result = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                             "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
                             f"--screenshot={tmp_path / 'gate.png'}", "--window-size=1200,2400", page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and (tmp_path / "gate.png").stat().st_size > 10_000, result.stderr[-1000:]
    dom = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-1000:]
    return dom.stdout


def test_gate_fails_the_field_note_change_naming_its_eviction_and_passes_the_reverse(
        gpucanary_fleet, kube: Kube, tmp_path: Path, policy_before: dict) -> None:  # noqa: F811
    forward = gate(POLICIES / "default.yaml", POLICIES / "field-note.yaml", tmp_path / "reports", "e2e-fwd")
    assert forward.returncode == 1, forward.stdout[-2000:] + forward.stderr[-3000:]
    assert "gate: running base and head in parallel" in forward.stderr
    document = json.loads((tmp_path / "reports" / "gate-e2e-fwd" / "gate.json").read_text())
    assert document["gate_passed"] is False and document["head"]["first_failed"] == "application"
    [added] = [r["line"] for r in document["regressions"] if r["rule"] == "evictions"]
    assert "non-GPU pod gpucanary-e2e-fwd-head/sched-api-" in added and "evicted by drain" in added
    assert {"stage": "application", "base": "pass", "head": "fail"} in document["stages"]
    markdown = (tmp_path / "reports" / "gate-e2e-fwd" / "gate.md").read_text()
    assert forward.stdout.strip().endswith("gate-e2e-fwd/gate.md")
    assert "- head only: non-GPU pod gpucanary-e2e-fwd-head/sched-api-" in markdown
    assert "`spec.driver.upgradePolicy.drain.enable: false -> true`" in markdown

    dom = chromium_dom(tmp_path / "reports" / "gate-e2e-fwd" / "gate.html", tmp_path)
    assert 'aria-label="upgrade timeline base"' in dom and 'aria-label="upgrade timeline head"' in dom
    assert "canary-e2e-fwd-base-0" in dom and "canary-e2e-fwd-head-0" in dom     # each run's pool node band

    reverse = gate(POLICIES / "field-note.yaml", POLICIES / "default.yaml", tmp_path / "reports", "e2e-rev")
    assert reverse.returncode == 0, reverse.stdout[-2000:] + reverse.stderr[-3000:]
    document = json.loads((tmp_path / "reports" / "gate-e2e-rev" / "gate.json").read_text())
    assert document["gate_passed"] is True and document["regressions"] == []
    assert_nothing_left(kube, policy_before)
