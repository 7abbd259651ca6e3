"""How sweep planning time grows with fleet size; run as `python tests/bench/bench_sweep.py`.

Not collected by pytest (no `test_` prefix). One process plans every size side by side, so the ratios
compare like with like. Times are wall-clock `time.perf_counter()` seconds for `plan_sweep` alone (the
fleet is built beforehand), best of --repeat runs, on one core (the planner is single-threaded).

The fleet: 20 workloads per node, on nodes advertising 32 `nvidia.com/gpu` (8 GPUs time-sliced 4 ways),
two GPU models and two driver/CUDA sets, a driver change. Workloads take 1 or 2 shares; 75 % hold a
checkpoint of their node's full set (restores on the old set only), 10 % one that does not record the
driver (restores anywhere), 15 % none; a quarter end within the sweep.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from pytest_gpucanary.sweep.model import Fleet, Node, SweepLimits, VersionSet, Workload, parse_change
from pytest_gpucanary.sweep.plan import plan_sweep
import figures  # tests/bench/figures.py: this run's output, kept for the docs

SHARES_PER_NODE = 32
WORKLOADS_PER_NODE = 20
SETS = (VersionSet("570.172.08", "12.8", "vllm-0.10.1", "llama-3.1-70b@1"),
        VersionSet("575.57.08", "12.9", "vllm-0.10.1", "llama-3.1-70b@1"))
MODELS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB")


def build_fleet(node_count: int, *, seed: int = 7) -> Fleet:
    rng = random.Random(seed)
    nodes = tuple(Node(f"gpu-{i:05d}", MODELS[i % 2], SHARES_PER_NODE, SETS[(i // 2) % 2]) for i in range(node_count))
    workloads = []
    for node in nodes:
        for j in range(WORKLOADS_PER_NODE):
            draw = rng.random()
            if draw < 0.75:
                checkpoint = node.versions
            elif draw < 0.85:
                checkpoint = VersionSet(cuda=node.versions.cuda, model=node.versions.model)
            else:
                checkpoint = None
            workloads.append(Workload(
                name=f"{node.name}-w{j:02d}", node=node.name, gpus=2 if j < 4 else 1, checkpoint=checkpoint,
                restore_s=rng.uniform(30, 120), cold_start_s=rng.uniform(600, 1800),
                since_start_s=rng.uniform(0, 86400), remaining_s=rng.uniform(600, 20000) if j % 4 == 0 else None,
            ))
    return Fleet(nodes, tuple(workloads))


def timed_plan(fleet: Fleet, *, repeat: int) -> tuple[float, object]:
    change = parse_change(["driver=580.95.05"])
    # each (GPU model, set) holds a quarter of the shares; three quarters of those must stay standing
    limits = SweepLimits(max_parallel=0, max_unavailable="10%", hold_back_gpus=len(fleet.nodes) * SHARES_PER_NODE * 3 // 16)
    best, plan = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        plan = plan_sweep(fleet, change, limits)
        best = min(best, time.perf_counter() - started)
    return best, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="500,1000,2000,5000", help="Node counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per size; the best is reported")
    args = parser.parse_args(argv)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        fleet = build_fleet(size)
        seconds, plan = timed_plan(fleet, repeat=args.repeat)
        moves = sum(len(w.moves) for w in plan.waves)
        rows.append((size, len(fleet.workloads), len(plan.waves), moves, seconds))
    base = rows[0][4] / rows[0][1]
    print(f"{'nodes':>6} {'workloads':>10} {'waves':>6} {'moves':>8} {'plan_s':>8} {'us/workload':>12} {'vs first':>9}")
    for size, workloads, waves, moves, seconds in rows:
        per = seconds / workloads
        print(f"{size:>6} {workloads:>10} {waves:>6} {moves:>8} {seconds:>8.3f} {per * 1e6:>12.2f} {per / base:>8.2f}x")
    print(f"(best of {args.repeat}; wall-clock perf_counter; plan_sweep only; python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    with figures.recorded(__file__):
        sys.exit(main())
