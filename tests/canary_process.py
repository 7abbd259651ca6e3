"""Start `gpucanary run` as its own process and follow it to the moment its policy is applied, for the e2e tests
that act on a run mid-upgrade (kill it, interrupt it, act on its pool); never part of the package."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from harness import CLI

APPLIED = "applied; upgrading the pool"     # the run's progress line once the policy under test is on the cluster


def run_until_applied(args: list[str], *, env: dict[str, str] | None = None,
                      **popen: Any) -> tuple[subprocess.Popen[str], list[str]]:
    """`gpucanary run <args>`, unbuffered (in `env`, default this process's), read until the policy is applied:
    the running process and the lines it printed so far."""
    proc = subprocess.Popen([*CLI, "run", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}, **popen)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if APPLIED in line:
            break
    return proc, seen
