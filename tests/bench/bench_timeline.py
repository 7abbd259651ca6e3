"""One pass over the timeline: what judging a large recorded run costs, and what recording it costs while the
run waits on it.

Builds a synthetic timeline shaped like the canned records of tests/ladder/test_ladder.py, scaled: NODES GPU
nodes listed at the start, the pool's nodes (the first POOL) going through the operator's upgrade states with
their events, the GPUs leaving allocatable and coming back, their operands restarted and their GPU pods
evicted; every other node's labels updated once a minute (GPU Feature Discovery) and two events each; about
10 pods per node, listed, updated, some replaced; the GPU job, the service and the probe Jobs' pods in the
run's namespace. Then measures:

(a) `ladder.evaluate` on it: wall time (best of REPEAT), with a digest of the result (the same digest
    before and after a change means the same verdicts, evidence and figures);
(b) the recorder appending every record (`Recorder._append`, a fake kube, no cluster) while one waiter
    thread goes through the run's waits in order, as the run passes them to `Recorder.wait_for`: the GPU
    job's and the service's pods Running, every pool node at an end state, a pool probe running after the
    upgrade, the GPU job over, every probe in flight running or ended. Records go in batches of BATCH (a
    watch's burst) and the waiter evaluates its wait once after each, as it does when records trickle in;
    the figure is the process' CPU time for the appends and the evaluations together.

Run: python tests/bench/bench_timeline.py [--nodes 1000] [--pool 10] [--batch 50] [--repeat 3]
(PYTHONPATH set to the tree to measure).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from pytest_gpucanary.canary import stage, waits
from pytest_gpucanary.canary.probes import ProbeLoop
from pytest_gpucanary.canary.recorder import Recorder
from pytest_gpucanary.gpu_operator import DRIVER_VERSION_LABEL, UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder import RunEvidence, WorkloadRef, evaluate, jobs, timeline
from pytest_gpucanary.ladder.timeline import Record
import figures  # tests/bench/figures.py: this run's output, kept for the docs

T0 = 1_767_000_000 * 10**9
OLD, NEW = "580.82.07", "580.95.05"
RUN_NS = "gpucanary-bench"
HAPPY = ["upgrade-required", "cordon-required", "wait-for-jobs-required", "pod-deletion-required",
         "pod-restart-required", "validation-required", "uncordon-required", "upgrade-done"]
END_S = 900


def at(offset_s: float) -> int:
    return T0 + int(offset_s * 1e9)


def node(offset_s: float, name: str, *, state: str, gpus: str = "8", driver: str = OLD, beat: int = 0,
         kind_type: str = "MODIFIED") -> Record:
    labels = {UPGRADE_STATE_LABEL: state, DRIVER_VERSION_LABEL: driver, "nvidia.com/gfd.timestamp": str(beat)}
    obj = {"metadata": {"name": name, "labels": labels},
           "spec": {"unschedulable": state not in ("", "upgrade-done", "upgrade-required")},
           "status": {"allocatable": {"cpu": "110", "nvidia.com/gpu": gpus},
                      "conditions": [{"type": "Ready", "status": "True"}]}}
    return Record(f"node-{name}", kind_type, "Node", None, name, at(offset_s), at(offset_s), obj)


def pod(offset_s: float, namespace: str, name: str, *, labels: dict, node_name: str | None, gpus: int = 0,
        phase: str = "Running", ready: bool = True, image: str = "api", owner: str = "ReplicaSet",
        removing: bool = False, disruption: str = "", kind_type: str = "MODIFIED") -> Record:
    meta = {"namespace": namespace, "name": name, "uid": f"uid-{namespace}-{name}", "labels": labels,
            "ownerReferences": [{"kind": owner, "name": "owner"}]}
    if removing:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conditions = [{"type": "DisruptionTarget", "status": "True", "reason": disruption}] if disruption else []
    if node_name:
        conditions.append({"type": "PodScheduled", "status": "True"})
    if phase == "Running" and ready:
        conditions.append({"type": "Ready", "status": "True"})
    statuses = [{"name": "main", "image": image, "ready": ready}] if phase in ("Running", "Succeeded") else []
    obj = {"metadata": meta, "spec": {"nodeName": node_name, "gpus": gpus, "emptyDirs": []},
           "status": {"phase": phase, "conditions": conditions, "containerStatuses": statuses}}
    return Record(f"pods-{node_name}", kind_type, "Pod", namespace, name, at(offset_s), at(offset_s), obj)


def event(offset_s: float, name: str, reason: str, message: str) -> Record:
    obj = {"metadata": {"namespace": "default", "name": f"{name}.{offset_s}", "uid": f"ev-{name}-{offset_s}"},
           "involvedObject": {"kind": "Node", "name": name}, "reason": reason, "type": "Normal",
           "message": message, "source": {"component": "nvidia-gpu-operator"}, "count": 1}
    return Record(f"events-{name}", "ADDED", "Event", "default", obj["metadata"]["name"], at(offset_s),
                  at(offset_s), obj)


def job(offset_s: float, *, active: int, succeeded: int = 0, complete: bool = False) -> Record:
    conditions = [{"type": "Complete", "status": "True"}] if complete else []
    obj = {"metadata": {"namespace": RUN_NS, "name": "train", "uid": "uid-job-train"},
           "spec": {"completions": 1, "parallelism": 1, "backoffLimit": 6},
           "status": {"active": active, "succeeded": succeeded, "conditions": conditions}}
    return Record("canary-jobs", "MODIFIED", "Job", RUN_NS, "train", at(offset_s), at(offset_s), obj)


def pool_node(name: str, start_s: float) -> list[Record]:
    """The upgrade of one pool node: its states and events, its GPUs' dip, its operands restarted, its GPU
    pods evicted at pod deletion and placed again after the uncordon."""
    records = []
    for i, state in enumerate(HAPPY):
        t = start_s + 20 * i
        gpus = "0" if state in ("pod-restart-required", "validation-required") else "8"
        driver = NEW if i >= HAPPY.index("validation-required") else OLD
        records += [node(t, name, state=state, gpus=gpus, driver=driver),
                    event(t + 0.2, name, "GPUDriverUpgrade", f"Successfully updated node state label to {state}")]
    restart_s = start_s + 20 * HAPPY.index("pod-restart-required")
    ds = dict(owner="DaemonSet", node_name=name)
    for app, labels, image in (
        ("driver", {"app.kubernetes.io/component": "nvidia-driver"}, "nvcr.io/nvidia/driver:{}-ubuntu22.04"),
        ("validator", {"app": "nvidia-operator-validator"}, "gpu-operator-validator"),
        ("plugin", {"app": "nvidia-device-plugin-daemonset"}, "k8s-device-plugin"),
    ):
        old, new = f"{app}-{name}-old", f"{app}-{name}-new"
        records += [pod(restart_s + 1, "gpu-operator", old, labels=labels, image=image.format(OLD), removing=True, **ds),
                    pod(restart_s + 3, "gpu-operator", old, labels=labels, image=image.format(OLD), removing=True,
                        kind_type="DELETED", **ds),
                    pod(restart_s + 5, "gpu-operator", new, labels=labels, phase="Pending", kind_type="ADDED", **ds),
                    pod(restart_s + 30 + 5 * (app != "driver"), "gpu-operator", new, labels=labels,
                        image=image.format(NEW), **ds)]
    deletion_s = start_s + 20 * HAPPY.index("pod-deletion-required")
    uncordon_s = start_s + 20 * HAPPY.index("upgrade-done")
    for i in range(2):  # its GPU pods: evicted, their replacements pending until the uncordon
        labels = {"app": f"gpu-work-{name}-{i}"}
        old, new = f"gpu-work-{name}-{i}", f"gpu-work-{name}-{i}-b"
        evicted = dict(labels=labels, gpus=1, node_name=name, removing=True, disruption="EvictionByEvictionAPI")
        records += [pod(deletion_s + 1 + i, "work", old, **evicted),
                    pod(deletion_s + 3 + i, "work", old, kind_type="DELETED", **evicted),
                    pod(deletion_s + 4 + i, "work", new, labels=labels, gpus=1, node_name=None, phase="Pending",
                        kind_type="ADDED"),
                    pod(uncordon_s + 5 + i, "work", new, labels=labels, gpus=1, node_name=name)]
    return records


def other_node(name: str, index: int) -> list[Record]:
    """A GPU node outside the pool: its labels refreshed once a minute, two events, one pod replaced."""
    records = [node(s, name, state="upgrade-done", beat=s) for s in range(index % 60, END_S, 60)]
    records += [event(100 + index % 300, name, "NodeHasSufficientMemory", "status is now: NodeHasSufficientMemory"),
                event(400 + index % 300, name, "NodeHasNoDiskPressure", "status is now: NodeHasNoDiskPressure")]
    labels = {"app": f"work-{name}-6"}
    old, new, t = f"work-{name}-6", f"work-{name}-6-b", 200 + index % 500
    records += [pod(t, "work", old, labels=labels, node_name=name, removing=True),
                pod(t + 2, "work", old, labels=labels, node_name=name, removing=True, kind_type="DELETED"),
                pod(t + 3, "work", new, labels=labels, node_name=None, phase="Pending", kind_type="ADDED"),
                pod(t + 4, "work", new, labels=labels, node_name=name, phase="Pending"),
                pod(t + 9, "work", new, labels=labels, node_name=name)]
    return records


def listed(name: str, index: int, pool: bool) -> list[Record]:
    """The node and its ~10 pods as the first list saw them, and one status update of each pod."""
    records = [node(-100, name, state="upgrade-done", kind_type="LISTED")]
    operands = {"driver": {"app.kubernetes.io/component": "nvidia-driver"},
                "validator": {"app": "nvidia-operator-validator"},
                "plugin": {"app": "nvidia-device-plugin-daemonset"}}
    pods = [(f"{app}-{name}-old", "gpu-operator", labels, "DaemonSet", 0) for app, labels in operands.items()]
    pods += [(f"gpu-work-{name}-{i}", "work", {"app": f"gpu-work-{name}-{i}"}, "ReplicaSet", 1)
             for i in range(2) if pool]
    pods += [(f"work-{name}-{i}", "work", {"app": f"work-{name}-{i}"}, "ReplicaSet", 0)
             for i in range(7 - 2 * pool)]
    for pod_name, namespace, labels, owner, gpus in pods:
        image = f"nvcr.io/nvidia/driver:{OLD}-ubuntu22.04" if "driver" in pod_name else "api"
        records += [pod(-100, namespace, pod_name, labels=labels, node_name=name, gpus=gpus, owner=owner,
                        image=image, kind_type="LISTED"),
                    pod(-90 + index % 60, namespace, pod_name, labels=labels, node_name=name, gpus=gpus,
                        owner=owner, image=image)]
    return records


def canary(pool: list[str], fleet: list[str]) -> tuple[list[Record], dict[str, tuple[str, int]]]:
    """The run's own namespace: the GPU job (evicted at the first pool node's pod deletion, its replacement
    done after the uncordon), the service, and a pool and a fleet probe Job every 10 s."""
    first = pool[0]
    deletion_s, done_s = 5 + 20 * HAPPY.index("pod-deletion-required"), 5 + 20 * HAPPY.index("upgrade-done")
    gpu = {"job-name": "train", "gpucanary.io/role": "gpu-job"}
    api = {"app": "sched-api", "gpucanary.io/role": "service"}
    records = [job(-40, active=0),
               pod(-40, RUN_NS, "train-a1", labels=gpu, node_name=None, gpus=1, owner="Job", phase="Pending",
                   kind_type="ADDED"),
               pod(-39, RUN_NS, "train-a1", labels=gpu, node_name=first, gpus=1, owner="Job", phase="Pending"),
               pod(-35, RUN_NS, "train-a1", labels=gpu, node_name=first, gpus=1, owner="Job", image="pytorch"),
               job(-35, active=1),
               pod(-40, RUN_NS, "sched-api-7f9c", labels=api, node_name=None, phase="Pending", kind_type="ADDED"),
               pod(-33, RUN_NS, "sched-api-7f9c", labels=api, node_name=first),
               pod(deletion_s + 1, RUN_NS, "train-a1", labels=gpu, node_name=first, gpus=1, owner="Job",
                   removing=True, disruption="EvictionByEvictionAPI"),
               pod(deletion_s + 4, RUN_NS, "train-a1", labels=gpu, node_name=first, gpus=1, owner="Job",
                   removing=True, disruption="EvictionByEvictionAPI", kind_type="DELETED"),
               pod(deletion_s + 2, RUN_NS, "train-b2", labels=gpu, node_name=None, gpus=1, owner="Job",
                   phase="Pending", kind_type="ADDED"),
               pod(done_s + 5, RUN_NS, "train-b2", labels=gpu, node_name=first, gpus=1, owner="Job", image="pytorch"),
               pod(600, RUN_NS, "train-b2", labels=gpu, node_name=first, gpus=1, owner="Job", phase="Succeeded",
                   ready=False),
               job(601, active=0, succeeded=1, complete=True)]
    created: dict[str, tuple[str, int]] = {}
    for tick, t in enumerate(range(0, END_S - 20, 10)):
        for scope, where in (("pool", first), ("fleet", fleet[tick % len(fleet)])):
            name = f"probe-{scope}-{tick}"
            created[name] = (scope, at(t))
            labels = {"job-name": name, "gpucanary.io/role": "probe"}
            # the pool is cordoned for a while: its probes wait until the uncordon
            placed_s = max(t + 0.3, done_s + 1) if scope == "pool" and deletion_s - 40 < t < done_s else t + 0.3
            records += [pod(t + 0.1, RUN_NS, f"{name}-x", labels=labels, node_name=None, phase="Pending",
                            owner="Job", kind_type="ADDED"),
                        pod(placed_s, RUN_NS, f"{name}-x", labels=labels, node_name=where, phase="Pending", owner="Job"),
                        pod(placed_s + 2, RUN_NS, f"{name}-x", labels=labels, node_name=where, owner="Job"),
                        pod(placed_s + 8, RUN_NS, f"{name}-x", labels=labels, node_name=where, phase="Succeeded",
                            ready=False, owner="Job")]
    return records, created


def synthetic(nodes: int, pool_size: int) -> tuple[list[Record], list[str], dict[str, tuple[str, int]]]:
    names = [f"gpu-{i:04d}" for i in range(nodes)]
    pool, fleet = names[:pool_size], names[pool_size:] or names
    records: list[Record] = []
    for index, name in enumerate(names):
        records += listed(name, index, name in pool)
        records += pool_node(name, 5 + 10 * index) if name in pool else other_node(name, index)
    own, created = canary(pool, fleet)
    records += own
    records.sort(key=lambda r: r.received_wall_ns)
    return records, pool, created


def judge(records: list[Record], pool: list[str], created: dict[str, tuple[str, int]], repeat: int) -> None:
    evidence = RunEvidence(
        records=tuple(records), pool_nodes=tuple(pool), driver_from=OLD, driver_to=NEW, upgrade_started_wall_ns=T0,
        gpu_job=WorkloadRef(RUN_NS, "train"), service=WorkloadRef(RUN_NS, "sched-api"),
        probes=tuple(jobs.probes_seen(records, created, namespace=RUN_NS)), finished_wall_ns=at(END_S),
    )
    best = float("inf")
    for _ in range(repeat):
        fresh = RunEvidence(**{f: getattr(evidence, f) for f in evidence.__dataclass_fields__})
        started = time.perf_counter()
        result = evaluate(fresh)
        best = min(best, time.perf_counter() - started)
    digest = hashlib.sha256(repr(result).encode()).hexdigest()[:12]
    gate = "passed" if result.gate_passed else f"failed ({result.first_failed.value if result.first_failed else '-'})"
    print(f"(a) ladder.evaluate: {best:.3f} s wall (best of {repeat}); gate {gate}; result digest {digest}")


def run_waits(pool: list[str], created: dict[str, tuple[str, int]]) -> list[tuple[str, object]]:
    """The waits the run passes to `Recorder.wait_for`, in order, as this tree's run makes them."""
    probes = SimpleNamespace(created=created, placement=SimpleNamespace(namespace=RUN_NS))
    results = functools.partial(ProbeLoop.results, probes)
    done_ns = at(5 + 10 * (len(pool) - 1) + 20 * HAPPY.index("upgrade-done"))
    over = getattr(waits, "all_terminal", None)
    return [
        ("gpu-job Running", functools.partial(stage._running, namespace=RUN_NS, role="gpu-job")),
        ("service Running", functools.partial(stage._running, namespace=RUN_NS, role="service")),
        ("pool at an end state", functools.partial(over, nodes=tuple(pool)) if over else
         (lambda rs: True if all(timeline.terminal_state(rs, n) for n in pool) else None)),
        ("a pool probe running after", lambda rs: True if any(
            p.scope == "pool" and p.created_wall_ns > done_ns and p.running_wall_ns for p in results(rs)) else None),
        ("GPU job over", functools.partial(waits._job_over, job=WorkloadRef(RUN_NS, "train"))),
        ("every probe running or ended", lambda rs: True if all(
            p.running_wall_ns or p.ended_wall_ns for p in results(rs)) else None),
    ]


def record(records: list[Record], pool: list[str], created: dict[str, tuple[str, int]], batch: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-timeline-") as tmp:
        recorder = Recorder(SimpleNamespace(), Path(tmp) / "timeline.jsonl", []).start()
        evaluated = threading.Condition()
        count = {"evaluations": 0, "seen": []}

        def counted(predicate):
            def evaluate_once(rs):
                result = predicate(rs)
                with evaluated:
                    count["evaluations"] += 1
                    evaluated.notify_all()
                return result
            return evaluate_once

        def waiter() -> None:
            for what, predicate in run_waits(pool, created):
                try:
                    recorder.wait_for(counted(predicate), timeout_s=3600, what=what)
                    count["seen"].append(f"{what} at record {len(recorder.records)}")
                except TimeoutError:
                    count["seen"].append(f"{what}: not seen")
            with evaluated:
                count["evaluations"] = -1  # done: nothing more to wait for
                evaluated.notify_all()

        thread = threading.Thread(target=waiter, daemon=True)
        started_cpu, started = time.process_time(), time.perf_counter()
        thread.start()
        for first in range(0, len(records), batch):
            with evaluated:
                before = count["evaluations"]
            with recorder._changed:  # the batch arrives at once; the waiter wakes after it
                for r in records[first : first + batch]:
                    recorder._append(r)
            with evaluated:
                evaluated.wait_for(lambda: count["evaluations"] in (-1,) or count["evaluations"] > before)
        recorder.stop()
        thread.join()
        cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started
    print(f"(b) recorder: {len(records)} records appended in batches of {batch} with the run's waits active: "
          f"{cpu:.2f} s CPU ({wall:.2f} s wall)")
    for line in count["seen"]:
        print(f"    {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pool", type=int, default=10)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    records, pool, created = synthetic(args.nodes, args.pool)
    print(f"{args.nodes} GPU nodes, pool of {len(pool)}: {len(records)} records "
          f"({sum(r.kind == 'Pod' for r in records)} of pods); python {sys.version.split()[0]}")
    judge(records, pool, created, args.repeat)
    record(records, pool, created, args.batch)


if __name__ == "__main__":
    with figures.recorded(__file__):
        main()
