"""The cgroup tree of one kubelet node: made before the kubelet starts, emptied and removed after.

The kubelet runs with `cgroupRoot: /<root>` (cgroupfs driver), so every pod and container cgroup of
a node lives under that one directory in each mounted hierarchy (cgroup v1 controllers, the named
systemd hierarchy and the hybrid unified one). Nothing else of the machine's cgroups is touched.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")


def hierarchies() -> list[Path]:
    """Each mounted hierarchy once (cpu -> cpu,cpuacct style links are skipped)."""
    if not CGROUP_FS.is_dir():
        return []
    return sorted(path for path in CGROUP_FS.iterdir() if path.is_dir() and not path.is_symlink())


def create(root: str) -> None:
    """`/<root>` in every hierarchy; cpuset needs cpus and mems copied from its parent before use."""
    for hierarchy in hierarchies():
        path = hierarchy / root
        path.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (path / name).exists() and not (path / name).read_text().strip():
                (path / name).write_text((hierarchy / name).read_text())


def trees(root: str) -> list[Path]:
    """Every cgroup directory at or under `/<root>`, deepest first."""
    found: list[Path] = []
    for hierarchy in hierarchies():
        top = hierarchy / root
        if top.is_dir():
            found.extend(Path(d) for d, _, _ in os.walk(top, topdown=False))
    return found


def pids(root: str) -> set[int]:
    found: set[int] = set()
    for path in trees(root):
        try:
            found.update(int(line) for line in (path / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            pass
    return found


def kill_all(root: str, *, timeout_s: float = 10.0) -> int:
    """SIGKILL every process in the tree (pods' containers and pause processes); returns how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while (alive := pids(root)) and time.monotonic() < deadline:
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed |= alive
        time.sleep(0.1)
    return len(killed)


def remove(root: str) -> list[Path]:
    """rmdir the tree deepest first; returns what could not be removed (still has processes)."""
    left = []
    for path in trees(root):
        try:
            path.rmdir()
        except OSError:
            left.append(path)
    return left
