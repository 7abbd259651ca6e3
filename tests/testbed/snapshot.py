"""Everything a canary run may touch on the fleet, as one comparable value, and runs killed on cue.

`snapshot` reads (never writes) what a run changes and must put back: every node's labels,
annotations, taints and schedulability (a run's own pool nodes are gone again afterwards, so they
appear in neither snapshot); the ClusterPolicy's and every NVIDIADriver's spec, labels and
annotations; the namespaces that exist and are not being deleted; and every object labelled
managed-by=gpucanary. Status, resourceVersion, generation and managedFields are left out: the
operator and the controllers move them on their own.

`run_killed` starts `gpucanary run` as CI would, reads its progress lines as they come, sends a
signal when `cue(line)` says so, and returns the run's audit-log window (tests/testbed/audit_run.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pytest_gpucanary.canary.load import sigint_default
from testbed.audit import read_log
from testbed.audit_run import CANARY_USER_AGENT, CanaryResult, fence, new_run_id
from pytest_gpucanary.fleet.fleet import Fleet
from pytest_gpucanary.gpu_operator import CLUSTER_POLICY, NVIDIADRIVER
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.ownership import OWNER_LABEL

Snapshot = dict[str, object]


def _meta(obj: dict) -> dict:
    meta = obj["metadata"]
    return {"labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}}


def snapshot(kube: Kube) -> Snapshot:
    nodes = {
        n["metadata"]["name"]: {
            **_meta(n),
            "taints": n.get("spec", {}).get("taints") or [],
            "unschedulable": bool(n.get("spec", {}).get("unschedulable")),
        }
        for n in kube.list("v1", "Node")
    }
    policies = {
        f"{kind}/{o['metadata']['name']}": {**_meta(o), "spec": o.get("spec")}
        for api, kind in (CLUSTER_POLICY, NVIDIADRIVER)
        for o in kube.list(api, kind)
    }
    namespaces = sorted(
        n["metadata"]["name"] for n in kube.list("v1", "Namespace") if not n["metadata"].get("deletionTimestamp")
    )
    # an earlier run's namespace still terminating is on its way out, not something this run left
    owned = sorted(
        f"{kind}/{o['metadata']['name']}"
        for api, kind in (("v1", "Node"), ("v1", "Namespace"), NVIDIADRIVER)
        for o in kube.list(api, kind, label_selector=f"{OWNER_LABEL}=gpucanary")
        if not o["metadata"].get("deletionTimestamp")
    )
    return {"nodes": nodes, "policies": policies, "namespaces": namespaces, "owned": owned}


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    """One line per thing that differs, naming it: what a failed comparison prints."""
    lines = []
    for section in before.keys() | after.keys():
        old, new = before.get(section), after.get(section)
        if isinstance(old, dict) and isinstance(new, dict):
            for key in sorted(old.keys() | new.keys()):
                lines += _changed(f"{section}/{key}", old.get(key), new.get(key))
        elif old != new:
            lines.append(f"{section}: {old} -> {new}")
    return lines


def _changed(path: str, old: object, new: object) -> list[str]:
    """The leaves that differ, by path (a node's one label, not the whole node)."""
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            line
            for key in sorted(old.keys() | new.keys(), key=str)
            for line in _changed(f"{path}.{key}", old.get(key), new.get(key))
        ]
    return [f"{path}: {str(old)[:300]} -> {str(new)[:300]}"]


def run_killed(
    fleet: Fleet,
    args: list[str],
    *,
    reports: Path,
    cue: Callable[[str], bool],
    sig: signal.Signals,
    env: dict[str, str] | None = None,
    timeout_s: float = 1200,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    command: Sequence[str] = (sys.executable, "-m", "pytest_gpucanary.cli"),
) -> CanaryResult:
    """`gpucanary run ARGS`, sent `sig` right after the first output line for which `cue` is true (never, if
    no line is). SIGKILL goes to its whole process group (its locust too), as a lost machine would. `command`
    runs the CLI (the tests' fault hooks wrap it)."""
    run_id = new_run_id()
    argv = [*command, "run", *args, f"--gpucanary-run-id={run_id}", f"--gpucanary-reports-dir={reports}"]
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "GPUCANARY_FLEET_KEEP": "1",
        "GPUCANARY_FLEET_DIR": str(fleet.layout.root),
        "GPUCANARY_FLEET_PORT_BASE": str(fleet.layout.port_base),
        "GPUCANARY_FLEET_GPU_NODES": str(fleet.layout.gpu_nodes),
        **(env or {}),
    }
    since_s = time.time()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    if on_start is not None:
        on_start(proc)
    timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    seen: list[str] = []
    sent = False
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            seen.append(line)
            if not sent and cue(line):
                seen.append(f"[test] sending {sig.name}\n")
                if sig is signal.SIGKILL:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.send_signal(sig)
                sent = True
        proc.wait()
    finally:
        timer.cancel()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left (a locust of a dead run)
    until_s = time.time()
    fence(fleet)
    records = read_log(fleet.layout.audit_log, user_agent_prefix=CANARY_USER_AGENT, since_s=since_s, until_s=until_s)
    return CanaryResult(run_id, argv, proc.returncode, "".join(seen), since_s, until_s, reports, records)
