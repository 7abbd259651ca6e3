"""Canned run records shaped like what the recorder captures during real upgrades (a clean upgrade, the field
note's drain, a node with GPUDirect RDMA): shared by the tests of the ladder, the receipt, the gate and the
canary's waits. Imported by its bare name (tests/ is on sys.path)."""

from __future__ import annotations

import dataclasses

from pytest_gpucanary.canary.recorder import Record
from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder import ProbeSeen, RunEvidence, WorkloadRef

T0 = 1_767_000_000 * 10**9          # upgrade start, wall clock ns
OLD, NEW = "580.82.07", "580.95.05"
NODE = "canary-0"
DRAIN_FALLBACK_MESSAGE = "Pod deletion failed but drain is enabled in spec. Will attempt a node drain"
HAPPY = ["upgrade-required", "cordon-required", "wait-for-jobs-required", "pod-deletion-required",
         "pod-restart-required", "validation-required", "uncordon-required", "upgrade-done"]


def at(offset_s: float) -> int:
    return T0 + int(offset_s * 1e9)


def node(offset_s: float, state: str, *, name: str = NODE, gpus: str = "8", kind_type: str = "MODIFIED") -> Record:
    obj = {"metadata": {"name": name, "labels": {UPGRADE_STATE_LABEL: state} if state else {}},
           "spec": {"unschedulable": state not in ("", "upgrade-done", "upgrade-required")},
           "status": {"allocatable": {"cpu": "110", "nvidia.com/gpu": gpus}}}
    return Record("nodes", kind_type, "Node", None, name, at(offset_s), at(offset_s), obj)


def pod(offset_s: float, namespace: str, name: str, *, labels: dict, node_name: str | None = NODE, gpus: int = 0,
        phase: str = "Running", ready: bool = True, image: str = "api", owner: str = "ReplicaSet",
        removing: bool = False, disruption: str = "", kind_type: str = "MODIFIED") -> Record:
    meta = {"namespace": namespace, "name": name, "uid": f"uid-{namespace}-{name}", "labels": labels,
            "ownerReferences": [{"kind": owner, "name": "owner"}]}
    if removing:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conditions = [{"type": "DisruptionTarget", "status": "True", "reason": disruption}] if disruption else []
    statuses = [{"name": "main", "image": image, "ready": ready}] if phase in ("Running", "Succeeded") else []
    obj = {"metadata": meta, "spec": {"nodeName": node_name, "gpus": gpus, "emptyDirs": []},
           "status": {"phase": phase, "conditions": conditions, "containerStatuses": statuses}}
    return Record("pods", kind_type, "Pod", namespace, name, at(offset_s), at(offset_s), obj)


def event(offset_s: float, message: str, *, name: str = NODE, warning: bool = False) -> Record:
    obj = {"metadata": {"namespace": "default", "name": f"{name}.{offset_s}", "uid": f"ev-{name}-{offset_s}"},
           "involvedObject": {"kind": "Node", "name": name}, "reason": "GPUDriverUpgrade",
           "type": "Warning" if warning else "Normal",
           "message": message, "source": {"component": "nvidia-gpu-operator"}, "count": 1}
    return Record("node-events", "ADDED", "Event", "default", obj["metadata"]["name"], at(offset_s),
                  at(offset_s), obj)


def states(schedule: list[tuple[float, str]], *, name: str = NODE) -> list[Record]:
    records = [node(-60, "upgrade-done", name=name, kind_type="LISTED")]
    for offset_s, state in schedule:
        gpus = "0" if state in ("pod-restart-required", "validation-required") else "8"  # device plugin paused
        records += [node(offset_s, state, name=name, gpus=gpus),
                    event(offset_s + 0.2, f"Successfully updated node state label to {state}", name=name)]
    return records


def operands(*, name: str = NODE, restart_s: float = 30, driver_tag: str = f"{NEW}-ubuntu22.04",
             validator_after: bool = True) -> list[Record]:
    """The operator's own DaemonSet pods: restarted during the upgrade, never counted as evictions. The
    driver manager removes the validator and device plugin while it swaps the driver; new ones come up
    after the new driver pod is Ready (or, `validator_after=False`, the old validator stays)."""
    driver = {"app.kubernetes.io/component": "nvidia-driver"}
    validator = {"app": "nvidia-operator-validator"}
    plugin = {"app": "nvidia-device-plugin-daemonset"}
    ds = dict(owner="DaemonSet", node_name=name)
    old_image = f"nvcr.io/nvidia/driver:{OLD}-ubuntu22.04"
    records = [pod(-50, "gpu-operator", f"driver-{name}-old", labels=driver, image=old_image, **ds),
               pod(-50, "gpu-operator", f"validator-{name}-old", labels=validator, image="gpu-operator-validator", **ds),
               pod(-50, "gpu-operator", f"plugin-{name}-old", labels=plugin, image="k8s-device-plugin", **ds),
               pod(restart_s, "gpu-operator", f"driver-{name}-old", labels=driver, removing=True, **ds),
               pod(restart_s + 1, "gpu-operator", f"plugin-{name}-old", labels=plugin, removing=True, **ds),
               pod(restart_s + 30, "gpu-operator", f"driver-{name}-new", labels=driver,
                   image=f"nvcr.io/nvidia/driver:{driver_tag}", **ds),
               pod(restart_s + 60, "gpu-operator", f"plugin-{name}-new", labels=plugin, image="k8s-device-plugin", **ds)]
    if validator_after:
        records += [pod(restart_s + 1, "gpu-operator", f"validator-{name}-old", labels=validator, removing=True, **ds),
                    pod(restart_s + 70, "gpu-operator", f"validator-{name}-new", labels=validator,
                        image="gpu-operator-validator", **ds)]
    return records


def workloads(*, evicted_at_s: float = 20, sched_api_evicted_at_s: float | None = None) -> list[Record]:
    job = {"job-name": "train", "app": "gpu-job"}
    api = {"app": "sched-api"}
    records = [pod(-40, "default", "train-a1", labels=job, gpus=1, owner="Job", image="pytorch"),
               pod(-40, "default", "sched-api-7f9c", labels=api),
               pod(evicted_at_s, "default", "train-a1", labels=job, gpus=1, owner="Job", removing=True,
                   disruption="EvictionByEvictionAPI"),
               pod(evicted_at_s + 5, "default", "train-a1", labels=job, gpus=1, owner="Job", removing=True,
                   disruption="EvictionByEvictionAPI", kind_type="DELETED"),
               pod(evicted_at_s + 1, "default", "train-b2", labels=job, gpus=1, owner="Job", node_name=None,
                   phase="Pending", kind_type="ADDED"),
               pod(150, "default", "train-b2", labels=job, gpus=1, owner="Job", image="pytorch"),
               pod(400, "default", "train-b2", labels=job, gpus=1, owner="Job", phase="Succeeded", ready=False)]
    if sched_api_evicted_at_s is not None:
        records += [pod(sched_api_evicted_at_s, "default", "sched-api-7f9c", labels=api, removing=True,
                        disruption="EvictionByEvictionAPI"),
                    pod(sched_api_evicted_at_s + 2, "default", "sched-api-7f9c", labels=api, removing=True,
                        disruption="EvictionByEvictionAPI", kind_type="DELETED")]
    return records


def probes(n: int = 3, *, queue_delay_s: float = 100.0, start_latency_s: float = 2.0) -> tuple[ProbeSeen, ...]:
    pool = [ProbeSeen(f"pool-{i}", "pool", at(10 + i), at(10 + i + queue_delay_s), at(12 + i + queue_delay_s),
                        NODE) for i in range(n)]
    fleet = [ProbeSeen(f"fleet-{i}", "fleet", at(20 * i), at(20 * i + 0.5), at(20 * i + start_latency_s),
                         "other-3") for i in range(n)]
    return tuple(pool + fleet)


def run(records: list[Record], **overrides) -> RunEvidence:
    base = dict(records=tuple(sorted(records, key=lambda r: r.received_wall_ns)), pool_nodes=(NODE,),
                driver_from=OLD, driver_to=NEW, upgrade_started_wall_ns=T0, gpu_job=WorkloadRef("default", "train"),
                service=WorkloadRef("default", "sched-api"), probes=probes())
    return RunEvidence(**{**base, **overrides})


def clean_run(**overrides) -> RunEvidence:
    schedule = list(zip([5, 10, 12, 14, 26, 90, 130, 135], HAPPY))
    return run(states(schedule) + operands() + workloads() + [node(500, "upgrade-done")], **overrides)


def field_note_run(**overrides) -> RunEvidence:
    """GPU pod deletion fails (shm emptyDir), drain is enabled: drain evicts the scheduler API pod too."""
    schedule = list(zip([5, 10, 12, 14, 60, 230, 290, 330, 335],
                        HAPPY[:4] + ["drain-required"] + HAPPY[4:]))
    records = (states(schedule) + operands(restart_s=231) + workloads(evicted_at_s=200, sched_api_evicted_at_s=212)
               + [event(59, DRAIN_FALLBACK_MESSAGE, warning=True),
                  node(600, "upgrade-done")])
    return run(records, **overrides)


def rdma_run(*, peermem_ready_after: bool = True, rdma_after: str = "63") -> RunEvidence:
    """The clean run on a node configured for GPUDirect RDMA: the driver pods carry nvidia-peermem-ctr,
    the node advertises the RDMA shared device plugin's resource."""
    records = []
    for record in clean_run().records:
        obj = record.object
        if record.kind == "Pod" and obj.get("metadata", {}).get("name", "").startswith("driver-"):
            ready = peermem_ready_after or obj["metadata"]["name"].endswith("-old")
            obj = {**obj, "status": {**obj["status"], "containerStatuses": obj["status"]["containerStatuses"] + [
                {"name": "nvidia-peermem-ctr", "image": "driver", "ready": ready}]}}
        if record.kind == "Node" and "status" in obj:
            late = record.received_wall_ns > at(200)
            allocatable = {**obj["status"]["allocatable"], "rdma/rdma_shared_device_a": rdma_after if late else "63"}
            obj = {**obj, "status": {**obj["status"], "allocatable": allocatable}}
        records.append(dataclasses.replace(record, object=obj))
    return run(records)
