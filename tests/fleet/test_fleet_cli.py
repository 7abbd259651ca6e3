"""`gpucanary fleet` refuses bad situations with one line and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from pytest_gpucanary.fleet.layout import FleetLayout
from pytest_gpucanary.fleet import processes
from harness import gpucanary, port_beside_session, second_fleet_env

pytestmark = pytest.mark.e2e

# Away from the session fleet's ports, and from another session fleet's on its own base.
PORT_BASE = port_beside_session("fleet-cli")


@pytest.fixture
def fleet_env(tmp_path: Path, gpucanary_fleet) -> dict[str, str]:
    # the session fleet has built the binaries; this second fleet reuses them
    return second_fleet_env("fleet-cli", tmp_path / "fleet", gpucanary_fleet, GPUCANARY_FLEET_GPU_NODES="1")


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
        result = gpucanary("fleet", "up", env=fleet_env, timeout_s=600, unbuffered=False)
    assert_one_line_error(result, f"127.0.0.1:{PORT_BASE + 43}", "already in use", "GPUCANARY_FLEET_PORT_BASE")
    assert processes.owned_pids(layout(fleet_env)) == []


def test_up_with_a_missing_binary_fails_in_one_line(fleet_env: dict[str, str], tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    result = gpucanary("fleet", "up", env={**fleet_env, "GPUCANARY_BIN_DIR": str(empty)}, timeout_s=600,
                       unbuffered=False)
    assert_one_line_error(result, "missing binary", str(empty / "etcd"))
    assert processes.owned_pids(layout(fleet_env)) == []


def test_half_started_fleet_is_refused_and_down_leaves_nothing(fleet_env: dict[str, str]) -> None:
    up = gpucanary("fleet", "up", env=fleet_env, timeout_s=600, unbuffered=False)
    assert up.returncode == 0, up.stderr
    try:
        status = gpucanary("fleet", "status", env=fleet_env, timeout_s=600, unbuffered=False)
        assert status.returncode == 0, status.stdout
        assert "gpu-node-0" in status.stdout and "cpu-node-0" in status.stdout

        scheduler = processes.pid_of(layout(fleet_env), "kube-scheduler")
        assert scheduler is not None
        os.kill(scheduler, signal.SIGKILL)
        again = gpucanary("fleet", "up", env=fleet_env, timeout_s=600, unbuffered=False)
        assert_one_line_error(again, "half-started", "gpucanary fleet down")
    finally:
        down = gpucanary("fleet", "down", env=fleet_env, timeout_s=600, unbuffered=False)
    assert down.returncode == 0, down.stderr
    assert processes.owned_pids(layout(fleet_env)) == []
    busy = [port for port in range(PORT_BASE, PORT_BASE + 100) if processes.port_in_use(port)]
    assert busy == []
