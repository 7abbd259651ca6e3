"""What the end-to-end tests share, in one place: the `gpucanary` command as a subprocess, the target driver
and the fast run options, what a run must leave behind, and the ports and environment of a fleet beside the
session's. Imported by its bare name (tests/ is on sys.path); never part of the package. The fixtures the
tests share are in conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pytest_gpucanary.fleet.binaries import CI_DIR
from pytest_gpucanary.fleet.kubelet_node import TAINT_KEY, node_name
from pytest_gpucanary.fleet.layout import DEFAULT_PORT_BASE
from pytest_gpucanary.shipped import FIXTURES
from pytest_gpucanary.kube import Kube

TARGET = "580.95.05"            # the driver the runs upgrade to
FLEET_DRIVER = "580.82.07"      # what every fleet node runs before
# a 2-core CI machine runs the fleet, the operator and locust at once; the GPU job keeps the default
# a GPU job of 180 s: still running when pod deletion comes (seconds after the policy, after a 10 s
# baseline; a job done by then is inconclusive), and no longer than the wait for the uncordon on v26.7,
# where its replacement starts
def fast(*, job_duration_s: int = 180) -> list[str]:
    """The fast run options, with a GPU job of `job_duration_s`."""
    return ["--gpucanary-probe-interval-s=10", "--gpucanary-upgrade-budget-s=420", "--gpucanary-max-p99-s=3",
            "--gpucanary-baseline-s=10", f"--gpucanary-job-duration-s={job_duration_s}"]


FAST = fast()
KEEP_FLEET = {"GPUCANARY_FLEET_KEEP": "1"}     # a run that found the fleet down leaves it up after


def unbuffered() -> dict[str, str]:
    """This process's environment as it is now (a worker's fleet is set in pytest_configure, after imports),
    unbuffered, with the fleet kept."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **KEEP_FLEET}


CLI = (sys.executable, "-m", "pytest_gpucanary.cli")      # `gpucanary`, from this checkout


def gpucanary(*args: str, env: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None,
              unbuffered: bool = True, timeout_s: float = 900, reports: Path | None = None, cwd: Path | None = None,
              check: bool = False, program: Sequence[str] = CLI) -> subprocess.CompletedProcess[str]:
    """`gpucanary <args>` in a subprocess, its output captured as text, killed after `timeout_s`.

    Its environment is `base` (this process's at the call if None) with `env` over it, and PYTHONUNBUFFERED=1
    unless `unbuffered` is false. With `reports`, a `run` also gets --gpucanary-reports-dir=<reports> (other
    commands ignore it). `program` is the command: this checkout's by default, or an installed console script."""
    environment = {**(os.environ if base is None else base), **(env or {})}
    if unbuffered:
        environment["PYTHONUNBUFFERED"] = "1"
    command = [*program, *args]
    if reports is not None and args[0] == "run":
        command.append(f"--gpucanary-reports-dir={reports}")
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=environment, cwd=cwd,
                          check=check)


T = TypeVar("T")


def eventually(seen: Callable[[], T], *, timeout_s: float, every_s: float = 1,
               stop: threading.Event | None = None) -> T:
    """For what has no watch (Prometheus, a process, an HTTP stand-in): `seen()` every `every_s` until it is
    truthy, `stop` is set or `timeout_s` passed; returns its last value. Kubernetes objects are waited for with
    `kube.wait_for` / `kube.watch_until`, which watch instead of looking again."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while not (value := seen()) and not stop.is_set() and time.monotonic() < deadline:
        stop.wait(every_s)
    return value


def go_built(package: str, out: Path) -> Path:
    """ci/<package> (a stand-in of the kubelet node's), built static from this checkout into `out`."""
    if shutil.which("go") is None:
        raise AssertionError("go is not installed (ci/install-deps.sh installs it)")
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
    subprocess.run(["go", "build", "-o", str(out), f"./{package}"], cwd=CI_DIR, env=env, check=True)
    return out


def receipt_of(reports: Path) -> dict:
    """The receipt of the one run under `reports`."""
    [run_dir] = [p for p in reports.iterdir() if p.is_dir()]
    return json.loads((run_dir / "receipt.json").read_text())


def live(items: list[dict]) -> list[str]:
    """Names of objects not already being deleted (namespace deletion finishes asynchronously)."""
    return [i["metadata"]["name"] for i in items if not i["metadata"].get("deletionTimestamp")]


def assert_nothing_left(kube: Kube, policy_before: dict) -> None:
    """No run's namespace, pool node or NVIDIADriver is left, and the ClusterPolicy's upgradePolicy is the one
    before (the `policy_before` fixture), with no saved spec on it."""
    assert not [n for n in live(kube.list("v1", "Namespace")) if n.startswith("gpucanary-")]
    assert not live(kube.list("v1", "Node", label_selector="app.kubernetes.io/managed-by=gpucanary"))
    assert not live(kube.list("nvidia.com/v1alpha1", "NVIDIADriver",
                              label_selector="app.kubernetes.io/managed-by=gpucanary"))
    policy = kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")
    assert policy["spec"]["driver"]["upgradePolicy"] == policy_before
    assert "gpucanary.io/saved-spec" not in policy["metadata"].get("annotations", {})


def eventually_nothing_left(kube: Kube, policy_before: dict, timeout_s: float = 60) -> None:
    """`assert_nothing_left` once namespace deletion, which finishes asynchronously, has had `timeout_s`."""

    def nothing_left() -> bool:
        try:
            assert_nothing_left(kube, policy_before)
        except AssertionError:
            return False
        return True

    eventually(nothing_left, timeout_s=timeout_s, every_s=2)
    assert_nothing_left(kube, policy_before)


# --- ports beside the session fleet's ------------------------------------------------------------------------

# tests/conftest.py gives pytest-xdist worker n the session's port base - 4,000 n, so everything a worker runs
# beside its own fleet stays within 4,000 ports above its base; a fleet's own ports are its base to + 99
# (pytest_gpucanary/fleet/layout.py).
WORKER_PORT_SPACING = 4000
FLEET_PORTS = 100
# The offset from the session fleet's port base of what each e2e module runs beside it: a fleet of its own
# (FLEET_PORTS ports from there), or one port. One table, so that no two share a port.
BESIDE_SESSION = {
    "fleet-cli": 1000,          # test_fleet_cli.py: fleets that fail to come up, and one half-started
    "clusterpolicy": 1200,      # test_clusterpolicy_mode.py: the ClusterPolicy-mode fleet
    "kubelet-node": 1400,       # test_kubelet_node.py: a fleet brought up and down to see what it leaves
    "prometheus": 1590,         # test_canary_gate.py: a Prometheus of its own, stopped mid-run (one port)
    "kubelet-pool": 1800,       # test_kubelet_pool.py: two real kubelet nodes as pools
    "releases": 2000,           # test_fleet_releases.py: one-node fleets on each release
    "restart-only": 2150,       # test_restart_only.py: the older release's fleet
    "rdma": 2250,               # test_network_rung.py: the GPUDirect RDMA fleet
    "widen": 2350,              # test_widen_rollout.py: widen's four-node fleet
    "dra": 2450,                # test_dra_cluster.py: KWOK GPU nodes that offer their GPUs through DRA
    "dra-kubelet": 2550,        # test_dra_cluster.py: a kubelet pool node with NVIDIA's DRA kubelet plugin
}


def _check_ports_apart() -> None:
    spans = sorted((offset, offset + (1 if purpose == "prometheus" else FLEET_PORTS), purpose)
                   for purpose, offset in BESIDE_SESSION.items())
    assert spans[0][0] >= FLEET_PORTS, "beside the session fleet's own ports"
    for (_, end, purpose), (start, _, other) in zip(spans, spans[1:]):
        assert end <= start, f"{purpose}'s ports overlap {other}'s"
    assert spans[-1][1] <= WORKER_PORT_SPACING, "the next xdist worker's fleet starts there"


_check_ports_apart()


def session_port_base() -> int:
    """The session fleet's port base (this xdist worker's, as tests/conftest.py set it)."""
    return int(os.environ.get("GPUCANARY_FLEET_PORT_BASE") or DEFAULT_PORT_BASE)


def port_beside_session(purpose: str) -> int:
    """The port base of `purpose`'s fleet (or its one port) beside the session's: BESIDE_SESSION."""
    return session_port_base() + BESIDE_SESSION[purpose]


def session_fleet_env(gpucanary_fleet: Any) -> dict[str, str]:
    """The settings that name the session's own fleet."""
    return {"GPUCANARY_FLEET_DIR": str(gpucanary_fleet.fleet.layout.root),
            "GPUCANARY_FLEET_PORT_BASE": str(gpucanary_fleet.fleet.layout.port_base)}


def second_fleet_env(purpose: str, root: Path, gpucanary_fleet: Any, **settings: str) -> dict[str, str]:
    """The settings of a fleet beside the session's, kept in `root`, on `purpose`'s port base, from the session
    fleet's control-plane binaries, with these GPUCANARY_* settings over them."""
    return {"GPUCANARY_FLEET_DIR": str(root), "GPUCANARY_FLEET_PORT_BASE": str(port_beside_session(purpose)),
            "GPUCANARY_BIN_DIR": str(gpucanary_fleet.fleet.bin_dir()), **settings}


def second_fleet(purpose: str, root: Path, gpucanary_fleet: Any, **settings: str) -> Iterator[dict[str, str]]:
    """A fleet beside the session's (`second_fleet_env`), from the same binaries (its GPU Operator build too,
    unless `settings` name another): its environment (KUBECONFIG_PATH too) while it runs; it is stopped after."""
    env = second_fleet_env(purpose, root, gpucanary_fleet, **{
        "GPUCANARY_OPERATOR_BIN_DIR": str(gpucanary_fleet.fleet.binaries().operator), **settings})
    up = gpucanary("fleet", "up", env=env)
    assert up.returncode == 0, up.stderr[-2000:]
    env["KUBECONFIG_PATH"] = up.stdout.strip().splitlines()[-1]
    yield env
    gpucanary("fleet", "down", env=env)


# --- shared by the kubelet node's own tests and the runs on it ----------------------------------------------

KUBELET_NODE = node_name(0)


def node_pod(name: str, namespace: str, script: str, *, gpus: int = 0, host_network: bool = False,
             grace_s: int = 30, shm: bool = False, restart: str = "Never") -> dict:
    container: dict = {"name": "main", "image": "localhost/gpucanary/busybox:1", "imagePullPolicy": "Never",
                       "command": ["sh", "-c", script]}
    spec: dict = {"nodeSelector": {"kubernetes.io/hostname": KUBELET_NODE},
                  "tolerations": [{"key": key, "operator": "Exists", "effect": "NoSchedule"}
                                  for key in (TAINT_KEY, "nvidia.com/gpu")],
                  "dnsPolicy": "Default", "restartPolicy": restart, "terminationGracePeriodSeconds": grace_s,
                  "hostNetwork": host_network, "containers": [container]}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    if shm:
        container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        spec["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def idle(token: str) -> str:
    """A shell command whose process carries `token` in its command line, so the machine's /proc finds it."""
    return f"exec sh -c 'while :; do sleep 1; done' {token}"


def phase_is(*phases: str):
    return lambda pod: pod.get("status", {}).get("phase") in phases


def refused_drain_options(root: Path, *, drain_timeout_s: int) -> tuple[str, str]:
    """The field note's policy (pod deletion refuses the job's /dev/shm, so the drain fallback must evict the
    service) with the drain's timeout, and the service whose budget allows no disruption at all: the run's
    --gpucanary-policy and --gpucanary-service, written under `root`."""
    policy = yaml.safe_load((FIXTURES / "policies" / "field-note.yaml").read_text())
    policy["spec"]["driver"]["upgradePolicy"]["drain"]["timeoutSeconds"] = drain_timeout_s
    service = list(yaml.safe_load_all((FIXTURES / "workloads" / "service.yaml").read_text()))
    [budget] = [doc for doc in service if doc["kind"] == "PodDisruptionBudget"]
    budget["spec"] = {"maxUnavailable": 0, "selector": budget["spec"]["selector"]}
    root.mkdir(parents=True, exist_ok=True)
    (root / "policy.yaml").write_text(yaml.safe_dump(policy))
    (root / "service.yaml").write_text(yaml.safe_dump_all(service))
    return f"--gpucanary-policy={root / 'policy.yaml'}", f"--gpucanary-service={root / 'service.yaml'}"
