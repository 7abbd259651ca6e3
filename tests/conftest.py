"""The test session: pytester, and under pytest-xdist one local fleet per worker.

`make test` runs the suite in three worker processes (the end-to-end files spend most of their time
waiting for the GPU Operator's 2-minute requeue, not computing). Each worker gets a fleet of its own:
worker n's port base is the session's - 4,000 n (the fleet's second fleets and extra ports live
below +4,000) and its state directory gets the worker's name, so two fleets never share a port,
a process or a file. The bases go down, not up: from 32768 the kernel hands ports to outgoing
connections, and one of those can take a fleet port between the check and the bind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from harness import eventually

from pytest_gpucanary.shipped import REPO_ROOT

pytest_plugins = ["pytester", "e2e_fixtures"]  # tests/e2e_fixtures.py

WORKER_PORT_SPACING = 4000


def pytest_configure(config: pytest.Config) -> None:
    # The test bed's fleets keep KWOK pools as their default (most e2e tests run several pools at once);
    # tests/canary/test_kubelet_pool.py brings up a fleet with the real node as its pool.
    os.environ.setdefault("GPUCANARY_FLEET_KUBELET_POOL", "0")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or worker == "gw0":
        return
    index = int(worker[2:])
    base = int(os.environ.get("GPUCANARY_FLEET_PORT_BASE") or 26400)
    worker_base = base - WORKER_PORT_SPACING * index
    if worker_base < 1024:
        raise pytest.UsageError(f"worker {worker}'s fleet port base {worker_base} is below 1024: "
                                "raise GPUCANARY_FLEET_PORT_BASE or run fewer workers")
    os.environ["GPUCANARY_FLEET_PORT_BASE"] = str(worker_base)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    default_dir = Path(os.environ.get("GPUCANARY_FLEET_DIR") or Path(state) / "gpucanary" / "fleet")
    os.environ["GPUCANARY_FLEET_DIR"] = f"{default_dir}-{worker}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def pushgateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus Pushgateway (Debian's, unpacked by ci/fetch-pushgateway.sh) on 127.0.0.1: its URL."""
    binary = subprocess.run(["bash", str(REPO_ROOT / "ci" / "fetch-pushgateway.sh")], capture_output=True, text=True,
                            check=True, timeout=300).stdout.strip()
    port, data = _free_port(), tmp_path_factory.mktemp("pushgateway")
    proc = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}",
                             f"--persistence.file={data / 'pushgateway.data'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2).close()
            except OSError:
                return False
            return True

        assert eventually(lambda: ready() or proc.poll() is not None, timeout_s=30, every_s=0.1) \
            and proc.poll() is None, "the Pushgateway did not start"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)

