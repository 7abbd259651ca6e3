"""`gpucanary lint POLICY [--against OLD_POLICY] [--json]`, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

POLICIES = Path(__file__).resolve().parents[2] / "fixtures" / "policies"


def lint_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpucanary.cli", "lint", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPUCANARY_TRACEBACK": ""})


@pytest.mark.parametrize("name", ["default.yaml", "nvidiadriver.yaml", "helm-values.yaml"])
def test_a_policy_without_errors_passes(name: str) -> None:
    result = lint_cli(str(POLICIES / name))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    findings = [line for line in result.stdout.splitlines() if not line.startswith(("rendered by helm", "chart "))]
    assert all(line.split()[0] in {"warning", "info"} for line in findings)


def test_the_field_note_policy_fails_with_one_finding_per_line() -> None:
    result = lint_cli(str(POLICIES / "field-note.yaml"))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("error drain-evicts-non-gpu spec.driver.upgradePolicy.drain.enable: a failed GPU pod "
                               "deletion falls back to a drain")
    assert any(line.startswith("warning emptydir-blocks-pod-deletion "
                               "spec.driver.upgradePolicy.podDeletion.deleteEmptyDir: ") for line in lines)
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("name", ["broken/malformed.yaml", "broken/missing-drain.yaml", "broken/unknown-field.yaml",
                                  "broken/wrong-type.yaml", "does-not-exist.yaml"])
def test_an_invalid_policy_is_a_usage_error_in_one_line(name: str) -> None:
    result = lint_cli(str(POLICIES / name))
    assert result.returncode == 4
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("gpucanary: error: ")
    assert str(POLICIES / name) in line


def test_an_invalid_old_policy_is_a_usage_error_too() -> None:
    result = lint_cli(str(POLICIES / "default.yaml"), "--against", str(POLICIES / "broken" / "wrong-type.yaml"))
    assert result.returncode == 4
    assert "drain.enable is the string 'false'" in result.stderr
    assert "Traceback" not in result.stderr


def test_against_shows_each_changed_knob_with_the_findings_it_brings() -> None:
    result = lint_cli(str(POLICIES / "field-note.yaml"), "--against", str(POLICIES / "default.yaml"))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    at = lines.index("change spec.driver.upgradePolicy.drain.enable: false -> true")
    assert lines[at + 1].startswith("  + error drain-evicts-non-gpu spec.driver.upgradePolicy.drain.enable: ")
    assert "change spec.driver.upgradePolicy.podDeletion.deleteEmptyDir: true -> false" in lines
    assert any(line.startswith("  - info pod-deletion-loses-emptydir ") for line in lines)
    assert any(line.startswith("error drain-evicts-non-gpu ") for line in lines)   # the full list follows


def test_reverting_the_field_note_policy_passes_and_says_what_it_removes() -> None:
    result = lint_cli(str(POLICIES / "default.yaml"), "--against", str(POLICIES / "field-note.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    changes = {c["knob"]: c for c in document["changes"]}
    assert changes["drain.enable"]["old"] is True and changes["drain.enable"]["new"] is False
    assert [f["code"] for f in changes["drain.enable"]["removed"]] == ["drain-evicts-non-gpu"]
    assert {f["severity"] for f in document["findings"]} <= {"warning", "info"}


def test_json_without_against_has_only_findings() -> None:
    result = lint_cli(str(POLICIES / "field-note.yaml"), "--json")
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert set(document) == {"findings"}
    first = document["findings"][0]
    assert set(first) == {"severity", "code", "path", "message"}
    assert (first["severity"], first["code"], first["path"]) == (
        "error", "drain-evicts-non-gpu", "spec.driver.upgradePolicy.drain.enable")


def test_lint_imports_neither_pytest_nor_kubernetes() -> None:
    code = ("import sys\n"
            "from pytest_gpucanary.cli import main\n"
            f"rc = main(['lint', {str(POLICIES / 'default.yaml')!r}])\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'kubernetes', 'pytest', '_pytest'})\n"
            "assert rc == 0 and not bad, (rc, bad)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
