"""`gpucanary` with fault hooks, for the tests that kill a run; never part of the package.

    python tests/fault_hooks.py run --gpucanary-... (the CLI's own arguments)

reads two settings from its environment, installs the hooks, then runs the CLI as `python -m
pytest_gpucanary.cli` would:

- GPUCANARY_TEST_CRASH_AFTER_WRITE=N (or N:Kind): the process ends with os._exit(137), as a SIGKILL would
  (no unwinding, no cleanup, no flush), right after its N-th successful write (create, patch, delete, evict;
  of Kind only, when given), counted over all threads. The tests kill a run between every pair of its writes
  with it, to prove each one leaves what undoes it on the cluster first.
- GPUCANARY_TEST_LEASE_DURATION_S=S: the run's Lease lasts S seconds instead of a minute, so that
  `gpucanary cleanup` sees a killed run gone after seconds.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import threading
from pathlib import Path
from typing import Any, Callable

CRASH_AFTER_WRITE_ENV = "GPUCANARY_TEST_CRASH_AFTER_WRITE"
LEASE_DURATION_ENV = "GPUCANARY_TEST_LEASE_DURATION_S"
SCRIPT = Path(__file__).resolve()


def argv(*args: str) -> list[str]:
    """The command line that runs `gpucanary ARGS` with the hooks its environment asks for."""
    return [sys.executable, str(SCRIPT), *args]


class CrashAfterWrite:
    def __init__(self, spec: str) -> None:
        count, _, kind = spec.partition(":")
        self.after = int(count) if count.strip().isdigit() else 0
        self.kind = kind.strip() or None
        self.seen = 0
        self._lock = threading.Lock()

    def wrote(self, kind: str) -> None:
        if self.after <= 0 or (self.kind is not None and kind != self.kind):
            return
        with self._lock:
            self.seen += 1
            if self.seen == self.after:
                os._exit(137)

    def wrap(self, method: Callable[..., Any], kind_of: Callable[..., str]) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.wrote(kind_of(*args, **kwargs))
            return result
        return counted


def install(environ: dict[str, str] | os._Environ = os.environ) -> None:
    from pytest_gpucanary.canary import lease
    from pytest_gpucanary.kube import Kube

    if (spec := environ.get(CRASH_AFTER_WRITE_ENV, "")).strip():
        hook = CrashAfterWrite(spec)
        Kube.create = hook.wrap(Kube.create, lambda self, manifest: manifest["kind"])
        Kube.delete = hook.wrap(Kube.delete, lambda self, api_version, kind, *a, **kw: kind)
        Kube.patch = hook.wrap(Kube.patch, lambda self, api_version, kind, *a, **kw: kind)
        Kube.evict = hook.wrap(Kube.evict, lambda *a, **kw: "Pod")
    if (raw := environ.get(LEASE_DURATION_ENV, "")).isdigit() and int(raw) > 0:
        lease.DURATION_S = int(raw)


if __name__ == "__main__":
    install()
    sys.argv = ["gpucanary", *sys.argv[1:]]
    runpy.run_module("pytest_gpucanary.cli", run_name="__main__", alter_sys=True)
