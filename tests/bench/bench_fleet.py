"""Fleet start-up time and memory, measured side by side in one run.

Starts a throw-away fleet on its own port base, times `up` (fresh data) against a second `up` on the
running fleet (the idempotent path) and `down`, and sums each component's resident memory.
Run: python tests/bench/bench_fleet.py [gpu_nodes ...]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from pytest_gpucanary.fleet import Fleet, processes
from pytest_gpucanary.fleet.layout import FleetLayout
import figures  # tests/bench/figures.py: this run's output, kept for the docs


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def measure(gpu_nodes: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        fleet = Fleet(FleetLayout(root=Path(root), port_base=29400, gpu_nodes=gpu_nodes))
        started = time.monotonic()
        fleet.up()
        cold_s = time.monotonic() - started
        started = time.monotonic()
        fleet.up()
        warm_s = time.monotonic() - started
        rss = {part: rss_kib(processes.pid_of(fleet.layout, part) or 0) for part in
               ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "prometheus")}
        started = time.monotonic()
        fleet.down()
        down_s = time.monotonic() - started
    return {"gpu_nodes": gpu_nodes, "up_s": cold_s, "up_again_s": warm_s, "down_s": down_s,
            "rss_mib": sum(rss.values()) / 1024, "apiserver_mib": rss["kube-apiserver"] / 1024}


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [4, 32]
    print(f"{'gpu nodes':>9} {'up s':>6} {'up again s':>10} {'down s':>7} {'RSS MiB':>8} {'apiserver MiB':>13}")
    for size in sizes:
        r = measure(size)
        print(f"{r['gpu_nodes']:>9} {r['up_s']:>6.1f} {r['up_again_s']:>10.2f} {r['down_s']:>7.1f} "
              f"{r['rss_mib']:>8.0f} {r['apiserver_mib']:>13.0f}")


if __name__ == "__main__":
    with figures.recorded(__file__):
        main(sys.argv[1:])
