"""P2: what one canary run asks of the apiserver, by verb and resource, on fleets of several sizes.

For each size: a fresh fleet (`fleet down`, then `fleet up` timed), one `gpucanary run` of the
default policy, then the canary's requests from the apiserver's audit log (user agent
gpucanary/<version>, received inside the run's wall-clock window). Watches and requests on the
run's own objects (its namespace, pool nodes, own NVIDIADriver) are counted apart from the rest;
the goal is <= 10/min for the rest, flat in fleet size. Also prints each fleet's `up` time and the
resident memory of its processes after the run.

Uses the fleet named by GPUCANARY_FLEET_DIR / GPUCANARY_FLEET_PORT_BASE (it is restarted!). With
--reuse, a running fleet of the size asked for is used as it is, with the start-up time it recorded.
Run: python tests/bench/bench_api_cost.py [--keep] [--reuse] [gpu_nodes ...]   (default 5 100 1000)
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.fleet import Fleet, processes
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the test bed's helpers (testbed/)
from testbed.audit import AuditRecord, RunScope, Scope
from testbed.audit_run import CanaryResult, run_canary
from pytest_gpucanary.shipped import FIXTURES
import figures  # tests/bench/figures.py: this run's output, kept for the docs

ARGS = [f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}", "--gpucanary-driver-version=580.95.05",
        "--gpucanary-probe-interval-s=10",
        # as the e2e gate tests: the fleet, the operator and locust share two cores; the default GPU job
        "--gpucanary-upgrade-budget-s=420", "--gpucanary-max-p99-s=3"]
OWN = (Scope.OWN_NAMESPACE, Scope.POOL_NODE, Scope.OWN_OBJECT)


def rss_mib(pid: int | None) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def category(record: AuditRecord, scope: RunScope) -> str:
    if record.is_watch:
        return "watch"
    return "own" if scope.scope_of(record) in OWN else "rest"


def cluster_wide(record: AuditRecord) -> bool:
    """A list of nodes or pods narrowed by neither namespace nor a field selector: one item per node."""
    return (record.verb == "list" and record.resource in ("nodes", "pods") and not record.namespace
            and "fieldSelector" not in record.request_uri)


@dataclass
class SizeResult:
    gpu_nodes: int
    up_s: float
    fleet_rss_mib: float
    apiserver_rss_mib: float
    canary: CanaryResult

    def counts(self) -> Counter:
        scope = self.canary.scope()
        return Counter((category(r, scope), r.verb, r.kind_key) for r in self.canary.records)

    def per_min(self, n: int) -> float:
        return n / (self.canary.duration_s / 60)


def measure(gpu_nodes: int, *, reports: Path, reuse: bool) -> SizeResult:
    fleet = Fleet.from_env().with_gpu_nodes(gpu_nodes)
    state = json.loads(fleet.layout.state_file.read_text()) if fleet.is_up() else {}
    if reuse and state.get("gpu_nodes") == gpu_nodes and state.get("startup_s"):
        up_s = state["startup_s"]
    else:
        fleet.down()
        started = time.monotonic()
        fleet.up(progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
        up_s = time.monotonic() - started
    print(f"  fleet of {gpu_nodes} GPU nodes up in {up_s:.1f} s; running the canary", file=sys.stderr, flush=True)
    canary = run_canary(fleet, ARGS, reports=reports)
    rss = {name: rss_mib(processes.pid_of(fleet.layout, name)) for name in processes.STOP_ORDER}
    return SizeResult(gpu_nodes, up_s, sum(rss.values()), rss["kube-apiserver"], canary)


def print_tables(results: list[SizeResult], *, out) -> None:
    print = functools.partial(builtins.print, file=out, flush=True)  # noqa: A001  (stdout, or stderr as progress)

    counts = [r.counts() for r in results]
    keys = sorted(set().union(*counts), key=lambda k: ({"rest": 0, "own": 1, "watch": 2}[k[0]], k[1], k[2]))
    head = "".join(f"{f'{r.gpu_nodes} nodes':>14}" for r in results)
    print(f"\ncanary requests in one run (n; audit log, apiserver clock 1 us; per min = n / run wall time)")
    print(f"{'class':<6} {'verb':<7} {'resource':<48}{head}")
    for key in keys:
        print(f"{key[0]:<6} {key[1]:<7} {key[2]:<48}" + "".join(f"{c.get(key, 0):>14}" for c in counts))
    for cls in ("rest", "own", "watch"):
        cells = []
        for r, c in zip(results, counts):
            n = sum(v for k, v in c.items() if k[0] == cls)
            cells.append(f"{n} ({r.per_min(n):.1f}/min)")
        print(f"{'total ' + cls:<63}" + "".join(f"{cell:>14}" for cell in cells))
    print(f"{'  of rest: cluster-wide node/pod lists':<63}"
          + "".join(f"{sum(1 for x in r.canary.records if cluster_wide(x)):>14}" for r in results))
    print(f"{'  of rest: writes to nodes outside the pool':<63}"
          + "".join(f"{sum(1 for x in r.canary.records if x.is_write and r.canary.scope().scope_of(x) == Scope.OTHER_NODE):>14}" for r in results))
    print(f"{'run wall time s':<63}" + "".join(f"{r.canary.duration_s:>14.1f}" for r in results))
    print(f"{'exit code':<63}" + "".join(f"{r.canary.returncode:>14}" for r in results))
    print(f"\n{'gpu nodes':>9} {'fleet up s':>10} {'fleet RSS MiB':>13} {'apiserver MiB':>13}  (fresh data dir; RSS after the run)")
    for r in results:
        print(f"{r.gpu_nodes:>9} {r.up_s:>10.1f} {r.fleet_rss_mib:>13.0f} {r.apiserver_rss_mib:>13.0f}")


def main(argv: list[str]) -> None:
    # KWOK pools, as the figures in docs/measurements.md were measured (the fleet's default pool is its kubelet node)
    os.environ.setdefault("GPUCANARY_FLEET_KUBELET_POOL", "0")
    keep, reuse = "--keep" in argv, "--reuse" in argv
    sizes = [int(a) for a in argv if not a.startswith("--")] or [5, 100, 1000]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for size in sizes:
                results.append(measure(size, reports=Path(tmp) / f"reports-{size}", reuse=reuse))
                if results[-1].canary.returncode != 0:
                    print(results[-1].canary.output[-2000:], file=sys.stderr)
                print_tables(results, out=sys.stderr)   # so far, in case a larger size fails
            print_tables(results, out=sys.stdout)       # while the receipts (the pool's node names) are there
        finally:
            if not keep:
                Fleet.from_env().down()


if __name__ == "__main__":
    with figures.recorded(__file__):
        main(sys.argv[1:])
