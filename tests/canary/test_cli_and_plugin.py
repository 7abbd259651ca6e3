"""The CLI and plugin surface, without a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def gpucanary(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpucanary.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_help_lists_the_exit_codes() -> None:
    result = gpucanary("--help")
    assert result.returncode == 0
    assert "0 ok" in result.stdout and "6 environment" in result.stdout


def test_bad_node_count_is_a_usage_error_in_one_line(tmp_path: Path) -> None:
    result = gpucanary("fleet", "status", env={"GPUCANARY_FLEET_GPU_NODES": "four",
                                                "GPUCANARY_FLEET_DIR": str(tmp_path)})
    assert result.returncode == 4
    assert result.stderr.strip() == "gpucanary: error: GPUCANARY_FLEET_GPU_NODES='four' is not a whole number"


def test_out_of_range_node_count_names_the_range(tmp_path: Path) -> None:
    result = gpucanary("fleet", "up", "--gpu-nodes", "0", env={"GPUCANARY_FLEET_DIR": str(tmp_path)})
    assert result.returncode == 4
    assert "use 1 to 1000" in result.stderr and "Traceback" not in result.stderr


def test_status_of_a_fleet_that_never_started_says_stopped(tmp_path: Path) -> None:
    result = gpucanary("fleet", "status", env={"GPUCANARY_FLEET_DIR": str(tmp_path)})
    assert result.returncode == 6
    assert "fleet" in result.stdout and "stopped" in result.stdout


def test_fleet_fixture_fails_in_one_line_when_the_fleet_cannot_start(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    empty = pytester.mkdir("bin")
    monkeypatch.setenv("GPUCANARY_BIN_DIR", str(empty))
    monkeypatch.setenv("GPUCANARY_FLEET_DIR", str(pytester.path / "fleet"))
    pytester.makepyfile("def test_needs_fleet(gpucanary_fleet):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:locust")
    assert result.ret == 6                    # could not run, which is not "the gate said no"
    result.stdout.fnmatch_lines(["*local test bed could not start: missing binary*"])
    assert result.stdout.str().count("local test bed could not start") == 1
    assert "Traceback" not in result.stdout.str()


def test_plugin_options_show_in_pytest_help(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help", "-p", "no:locust")
    result.stdout.fnmatch_lines(["*--gpucanary-fleet-keep*"])
