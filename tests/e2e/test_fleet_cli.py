"""`gpucanary fleet` refuses bad situations with one line and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpucanary.fleet.layout import FleetLayout
from pytest_gpucanary.fleet import processes

pytestmark = pytest.mark.e2e

# Away from the session fleet's ports, and from another session fleet's on its own base.
PORT_BASE = int(os.environ.get("GPUCANARY_FLEET_PORT_BASE") or 26400) + 1000


def gpucanary(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpucanary.cli", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def fleet_env(tmp_path: Path, gpucanary_fleet) -> dict[str, str]:
    # the session fleet has built the binaries; this second fleet reuses them
    return {"GPUCANARY_FLEET_DIR": str(tmp_path / "fleet"), "GPUCANARY_FLEET_PORT_BASE": str(PORT_BASE),
            "GPUCANARY_FLEET_GPU_NODES": "1", "GPUCANARY_BIN_DIR": str(gpucanary_fleet.fleet.bin_dir())}


def layout(env: dict[str, str]) -> FleetLayout:
    return FleetLayout(root=Path(env["GPUCANARY_FLEET_DIR"]).resolve(), port_base=PORT_BASE)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 6, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("gpucanary: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[-1]


def test_up_with_a_port_in_use_fails_in_one_line_and_starts_nothing(fleet_env: dict[str, str]) -> None:
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", PORT_BASE + 43))
        squatter.listen()
        result = gpucanary(fleet_env, "fleet", "up")
    assert_one_line_error(result, f"127.0.0.1:{PORT_BASE + 43}", "already in use", "GPUCANARY_FLEET_PORT_BASE")
    assert processes.owned_pids(layout(fleet_env)) == []


def test_up_with_a_missing_binary_fails_in_one_line(fleet_env: dict[str, str], tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    result = gpucanary({**fleet_env, "GPUCANARY_BIN_DIR": str(empty)}, "fleet", "up")
    assert_one_line_error(result, "missing binary", str(empty / "etcd"))
    assert processes.owned_pids(layout(fleet_env)) == []


def test_half_started_fleet_is_refused_and_down_leaves_nothing(fleet_env: dict[str, str]) -> None:
    up = gpucanary(fleet_env, "fleet", "up")
    assert up.returncode == 0, up.stderr
    try:
        status = gpucanary(fleet_env, "fleet", "status")
        assert status.returncode == 0, status.stdout
        assert "gpu-node-0" in status.stdout and "cpu-node-0" in status.stdout

        scheduler = processes.pid_of(layout(fleet_env), "kube-scheduler")
        assert scheduler is not None
        os.kill(scheduler, signal.SIGKILL)
        again = gpucanary(fleet_env, "fleet", "up")
        assert_one_line_error(again, "half-started", "gpucanary fleet down")
    finally:
        down = gpucanary(fleet_env, "fleet", "down")
    assert down.returncode == 0, down.stderr
    assert processes.owned_pids(layout(fleet_env)) == []
    busy = [port for port in range(PORT_BASE, PORT_BASE + 100) if processes.port_in_use(port)]
    assert busy == []
