"""Find the fleet's binaries: GPUCANARY_BIN_DIR, else the repo's cached Go build (built on first use)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from pytest_gpucanary.errors import EnvError

REQUIRED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "build.sh"


def find_bin_dir(progress: Callable[[str], None]) -> Path:
    explicit = os.environ.get("GPUCANARY_BIN_DIR")
    if explicit:
        bin_dir = Path(explicit)
    elif BUILD_SCRIPT.exists():
        bin_dir = _build(progress)
    else:
        raise EnvError("no fleet binaries found", hint="set GPUCANARY_BIN_DIR to a directory with "
                       + ", ".join(REQUIRED))
    missing = [name for name in REQUIRED if not os.access(bin_dir / name, os.X_OK)]
    if missing:
        raise EnvError(f"missing binary {bin_dir / missing[0]}",
                       hint=f"run {BUILD_SCRIPT} or point GPUCANARY_BIN_DIR at a complete build")
    return bin_dir


def _build(progress: Callable[[str], None]) -> Path:
    if shutil.which("go") is None:
        raise EnvError("Go is not installed, so the control plane cannot be built",
                       hint="install Go >= 1.26 or set GPUCANARY_BIN_DIR")
    progress(f"fleet: ensuring control plane binaries ({BUILD_SCRIPT.name}; a cold build takes minutes)")
    proc = subprocess.Popen(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None and proc.stdout is not None
    tail: list[str] = []
    for line in proc.stderr:
        tail = (tail + [line.rstrip()])[-5:]
        if not line.startswith("go: downloading"):
            progress(f"fleet: {line.rstrip()}")
    out = proc.stdout.read().strip()
    if proc.wait() != 0 or not out:
        raise EnvError(f"building the control plane failed: {tail[-1] if tail else 'no output'}",
                       hint=f"run bash {BUILD_SCRIPT} to see the whole log")
    return Path(out.splitlines()[-1])
