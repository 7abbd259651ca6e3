"""ci/node/allreduce, the kubelet node's stand-in for nccl-tests' all_reduce_perf, as two local
processes on 127.0.0.1: the table and summary lines, the termination message, and the exit codes
for a missing peer and a bad environment. Skipped only when ci/build-kubelet.sh has not built it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from pytest_gpucanary.fleet.binaries import CI_DIR
from pytest_gpucanary.fleet.kubelet_nodes import KUBELET_NODE_BUILD

SMALL_SIZES = ("-b", "64K", "-e", "1M", "-n", "2")
SUMMARY = re.compile(r"^# Out of bounds values : (\d+) (OK|FAILED)\n# Avg bus bandwidth    : (\d+\.\d{3})$", re.M)


def built_allreduce() -> Path:
    """The binary of GPUCANARY_KUBELET_BIN_DIR, else of the build cache when it matches these sources."""
    explicit = os.environ.get(KUBELET_NODE_BUILD.env_var)
    if explicit:
        bin_dir = Path(explicit)
    else:
        cached = subprocess.run(["bash", str(CI_DIR / KUBELET_NODE_BUILD.script), "--cached"],
                                capture_output=True, text=True, timeout=30)
        if cached.returncode != 0:
            pytest.skip("allreduce is not built: run bash ci/build-kubelet.sh")
        bin_dir = Path(cached.stdout.strip())
    if not (bin_dir / "allreduce").is_file():
        pytest.skip(f"{bin_dir} has no allreduce: run bash ci/build-kubelet.sh")
    return bin_dir / "allreduce"


@pytest.fixture
def allreduce() -> Path:
    return built_allreduce()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, port: int, **extra: str) -> dict[str, str]:
    return {**os.environ, "GPUCANARY_RANK": str(rank), "GPUCANARY_WORLD_SIZE": "2",
            "GPUCANARY_MASTER_ADDR": "127.0.0.1", "GPUCANARY_MASTER_PORT": str(port),
            "GPUCANARY_CONNECT_TIMEOUT_S": "20", **extra}


def test_two_ranks_all_reduce_and_print_the_nccl_tests_summary(allreduce: Path, tmp_path: Path) -> None:
    port = free_port()
    termination_log = tmp_path / "termination-log"
    termination_log.touch()       # as the kubelet does; rank 1's path does not exist, so it writes none
    missing_log = tmp_path / "no-termination-log"
    ranks = [subprocess.Popen([str(allreduce), *SMALL_SIZES], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=rank_env(rank, port, GPUCANARY_TERMINATION_LOG=str(log)))
             for rank, log in ((0, termination_log), (1, missing_log))]
    outputs = [rank.communicate(timeout=60) for rank in ranks]
    for rank, (stdout, stderr) in zip(ranks, outputs):
        assert rank.returncode == 0, stderr
        assert stdout.startswith("#")
        rows = [line.split() for line in stdout.splitlines() if not line.startswith("#")]
        assert [int(row[0]) for row in rows] == [64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20]
        assert all(row[2:4] == ["float", "sum"] and int(row[1]) * 4 == int(row[0]) and row[-1] == "0" for row in rows)
        summary = SUMMARY.search(stdout)
        assert summary is not None, stdout
        assert summary.group(1, 2) == ("0", "OK")
        assert float(summary.group(3)) > 0
    last_row = [line for line in outputs[0][0].splitlines() if not line.startswith("#")][-1]
    assert termination_log.read_text().splitlines() == [last_row, *SUMMARY.search(outputs[0][0]).group(0).splitlines()]
    assert not missing_log.exists()


def test_rank_1_without_rank_0_gives_up_with_exit_2(allreduce: Path) -> None:
    result = subprocess.run([str(allreduce), *SMALL_SIZES], capture_output=True, text=True, timeout=30,
                            env=rank_env(1, free_port(), GPUCANARY_CONNECT_TIMEOUT_S="1.5"))
    assert result.returncode == 2
    assert "cannot reach rank 0 at 127.0.0.1:" in result.stderr
    assert " within 1.5s: " in result.stderr      # it gave up at its connect timeout, the one set
    assert result.stdout == ""


@pytest.mark.parametrize(("setting", "value"), [("GPUCANARY_WORLD_SIZE", "4"), ("GPUCANARY_RANK", "2"),
                                                 ("GPUCANARY_MASTER_ADDR", "0.0.0.0")])
def test_bad_environment_is_one_line_and_exit_4(allreduce: Path, setting: str, value: str) -> None:
    result = subprocess.run([str(allreduce)], capture_output=True, text=True, timeout=30,
                            env=rank_env(0, free_port(), **{setting: value}))
    assert result.returncode == 4
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"allreduce: error: {setting}=")
