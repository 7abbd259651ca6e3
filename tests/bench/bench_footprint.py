"""P3: the canary's own footprint during one run on a large fleet with many other pods.

Needs a running fleet (GPUCANARY_FLEET_DIR / GPUCANARY_FLEET_PORT_BASE; e.g. left by
`bench_api_cost.py --keep 1000`). Puts PODS other pods on the fleet's own GPU nodes (Deployments of
1 replica-set each, node selector gpucanary.io/driver-pool=fleet, so none lands on the canary's
pool, which gets a pool label of its own), waits until they all run, then runs `gpucanary run` and
samples its process tree every 0.5 s from /proc: the canary process (`gpucanary run` and the pytest
session it is) apart from locust (its subprocess, with its workers). Peak RSS is the highest sample
(VmHWM for the canary, which the kernel keeps exactly); CPU share is CPU seconds / wall seconds, in
% of one core. Deletes the pods afterwards unless --keep-pods.

Run: python tests/bench/bench_footprint.py [--pods 10000] [--keep-pods]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pytest_gpucanary.fleet import Fleet
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the test bed's helpers (testbed/)
from testbed.audit_run import run_canary
from pytest_gpucanary.kube import Kube

sys.path.insert(0, str(Path(__file__).parent))
from bench_api_cost import ARGS  # noqa: E402  (same run as P2)
import figures  # tests/bench/figures.py: this run's output, kept for the docs

NAMESPACE = "bench-background"
DEPLOYMENTS = 20
SAMPLE_S = 0.5


@dataclass
class Usage:
    peak_rss_mib: float = 0.0
    cpu_s: dict[int, float] = field(default_factory=dict)   # pid -> last seen user+system CPU seconds
    first_s: float = 0.0
    last_s: float = 0.0

    @property
    def cpu_share(self) -> float:
        wall = self.last_s - self.first_s
        return sum(self.cpu_s.values()) / wall if wall > 0 else 0.0


class Sampler:
    """Samples the canary process and its locust subtree until the canary exits."""

    def __init__(self) -> None:
        self.canary, self.locust = Usage(), Usage()
        self.canary_hwm_mib = 0.0
        self.samples = 0

    def start(self, proc: subprocess.Popen) -> None:
        threading.Thread(target=self._run, args=(proc.pid,), daemon=True).start()

    def _run(self, pid: int) -> None:
        root = psutil.Process(pid)
        started = time.monotonic()
        self.canary.first_s = self.locust.first_s = started
        while True:
            try:
                children = root.children(recursive=True)
                self._add(self.canary, [root])
                self._add(self.locust, [c for c in children if "locust" in " ".join(c.cmdline())])
                self.canary_hwm_mib = max(self.canary_hwm_mib, _hwm_mib(pid))
            except psutil.NoSuchProcess:
                return
            self.samples += 1
            time.sleep(SAMPLE_S)

    def _add(self, usage: Usage, procs: list[psutil.Process]) -> None:
        rss = 0
        for proc in procs:
            try:
                times = proc.cpu_times()
                usage.cpu_s[proc.pid] = times.user + times.system   # children of locust are counted as their own
                rss += proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        usage.peak_rss_mib = max(usage.peak_rss_mib, rss / 2**20)
        usage.last_s = time.monotonic()


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def background(kube: Kube, pods: int) -> None:
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    kube.wait_for("v1", "ServiceAccount", "default", lambda sa: True, namespace=NAMESPACE, timeout_s=60)
    per = pods // DEPLOYMENTS
    for index in range(DEPLOYMENTS):
        labels = {"app": f"tenant-{index}"}
        kube.create({"apiVersion": "apps/v1", "kind": "Deployment",
                     "metadata": {"name": f"tenant-{index}", "namespace": NAMESPACE},
                     "spec": {"replicas": per, "selector": {"matchLabels": labels}, "template": {
                         "metadata": {"labels": labels},
                         "spec": {"nodeSelector": {"gpucanary.io/driver-pool": "fleet"},
                                  "containers": [{"name": "app", "image": "tenant-app",
                                                  "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}}}})
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:   # bench set-up only: a count every 10 s, not a canary wait
        ready = sum(d.get("status", {}).get("readyReplicas", 0) for d in kube.list("apps/v1", "Deployment",
                                                                                      namespace=NAMESPACE))
        print(f"  background pods ready: {ready}/{per * DEPLOYMENTS}", file=sys.stderr, flush=True)
        if ready >= per * DEPLOYMENTS:
            return
        time.sleep(10)
    raise TimeoutError("background pods did not all become ready in 30 min")


def main(argv: list[str]) -> None:
    # KWOK pools, as the figures in docs/measurements.md were measured (the fleet's default pool is its kubelet node)
    os.environ.setdefault("GPUCANARY_FLEET_KUBELET_POOL", "0")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=10000)
    parser.add_argument("--keep-pods", action="store_true")
    args = parser.parse_args(argv)
    fleet = Fleet.from_env()
    if not fleet.is_up():
        raise SystemExit("bench_footprint: the fleet is not up; run `gpucanary fleet up --gpu-nodes 1000` first")
    kube = Kube.connect(fleet.kubeconfig, user_agent="gpucanary-bench")
    nodes = len(kube.list("v1", "Node", label_selector="gpucanary.io/driver-pool=fleet"))
    fleet = fleet.with_gpu_nodes(nodes)
    started = time.monotonic()
    background(kube, args.pods)
    setup_s = time.monotonic() - started
    total_pods = len(kube.list("v1", "Pod"))
    sampler = Sampler()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_canary(fleet, ARGS, reports=Path(tmp) / "reports", on_start=sampler.start)
    if result.returncode != 0:
        print(result.output[-2000:], file=sys.stderr)
    if not args.keep_pods:
        kube.delete("v1", "Namespace", NAMESPACE)
    print(f"\nfleet: {nodes} GPU nodes, {total_pods} pods in the cluster before the run "
          f"({args.pods} background pods ready after {setup_s:.0f} s); machine: {os.cpu_count()} cores, shared")
    print(f"one canary run: {result.duration_s:.0f} s wall, exit {result.returncode}, "
          f"{sampler.samples} samples every {SAMPLE_S} s, {len(result.records)} canary requests")
    print(f"{'process':<28} {'peak RSS MiB':>12} {'CPU s':>7} {'CPU % of one core':>18}")
    canary_cpu = sum(sampler.canary.cpu_s.values())
    print(f"{'gpucanary run (pytest)':<28} {sampler.canary_hwm_mib:>12.0f} {canary_cpu:>7.1f} "
          f"{100 * sampler.canary.cpu_share:>18.1f}")
    locust_cpu = sum(sampler.locust.cpu_s.values())
    print(f"{'locust (load, subprocess)':<28} {sampler.locust.peak_rss_mib:>12.0f} {locust_cpu:>7.1f} "
          f"{100 * locust_cpu / max(sampler.canary.last_s - sampler.canary.first_s, 1e-9):>18.1f}")


if __name__ == "__main__":
    with figures.recorded(__file__):
        main(sys.argv[1:])
