"""One `gpucanary run` as a subprocess against the fleet, and the audit-log window it made.

Drives the canary only through its command line and reads only what it writes (reports/<run-id>/
receipt.json) and what the apiserver logged, so it does not depend on the canary's Python shapes.
The window is the client wall clock around the subprocess; a fence request with a user agent of
its own, awaited in the log afterwards, guarantees every request the canary made is already
written (blocking audit mode writes an event before the request returns to the apiserver's
handler chain, not necessarily before the client sees its response).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import eventually

from pytest_gpucanary import __version__
from testbed.audit import AuditRecord, RunScope, read_log
from pytest_gpucanary.fleet.fleet import Fleet
from pytest_gpucanary.kube import Kube

CANARY_USER_AGENT = f"gpucanary/{__version__}"
FENCE_WAIT_S = 30.0


@dataclass
class CanaryResult:
    run_id: str
    argv: list[str]
    returncode: int
    output: str  # stdout and stderr, interleaved
    since_s: float  # client wall clock, Unix s
    until_s: float
    reports: Path
    records: list[AuditRecord] = field(default_factory=list)  # the canary's requests in the window

    @property
    def duration_s(self) -> float:
        return self.until_s - self.since_s

    @property
    def receipt(self) -> dict | None:
        path = self.reports / self.run_id / "receipt.json"
        return json.loads(path.read_text()) if path.exists() else None

    def scope(self) -> RunScope:
        receipt = self.receipt or {}
        pool = set((receipt.get("run") or {}).get("pool_nodes") or ())
        return RunScope(self.run_id, frozenset(pool)).with_creates(self.records)


def new_run_id() -> str:
    return f"audit-{uuid.uuid4().hex[:8]}"


def fence(fleet: Fleet) -> None:
    """One request with a unique user agent, then wait (bounded) until the audit log holds it."""
    marker = f"gpucanary-audit-fence/{uuid.uuid4().hex}"
    Kube.connect(fleet.kubeconfig, user_agent=marker).get("v1", "Namespace", "default")
    needle = f'"userAgent":"{marker}'
    def logged() -> bool:
        with fleet.layout.audit_log.open(encoding="utf-8", errors="replace") as log:
            return any(needle in line for line in log)

    if eventually(logged, timeout_s=FENCE_WAIT_S, every_s=0.2):
        return
    raise TimeoutError(f"the fence request never reached {fleet.layout.audit_log} within {FENCE_WAIT_S:.0f} s")


def run_canary(
    fleet: Fleet,
    args: list[str],
    *,
    reports: Path,
    run_id: str | None = None,
    timeout_s: float = 1200,
    on_start: Callable[[subprocess.Popen], None] | None = None,
) -> CanaryResult:
    """`gpucanary run ARGS` with its own run id and reports dir; returns its audit window's canary requests.

    `on_start` gets the process right after it starts (a sampler measuring its footprint).
    """
    run_id = run_id or new_run_id()
    argv = [
        sys.executable,
        "-m",
        "pytest_gpucanary.cli",
        "run",
        *args,
        f"--gpucanary-run-id={run_id}",
        f"--gpucanary-reports-dir={reports}",
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "GPUCANARY_FLEET_KEEP": "1",
        "GPUCANARY_FLEET_DIR": str(fleet.layout.root),
        "GPUCANARY_FLEET_PORT_BASE": str(fleet.layout.port_base),
        "GPUCANARY_FLEET_GPU_NODES": str(fleet.layout.gpu_nodes),
    }
    since_s = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if on_start is not None:
        on_start(proc)
    output, _ = proc.communicate(timeout=timeout_s)
    until_s = time.time()
    fence(fleet)
    records = read_log(fleet.layout.audit_log, user_agent_prefix=CANARY_USER_AGENT, since_s=since_s, until_s=until_s)
    return CanaryResult(run_id, argv, proc.returncode, output, since_s, until_s, reports, records)
