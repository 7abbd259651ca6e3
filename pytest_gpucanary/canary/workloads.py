"""The canary's workloads from fixtures/ (or the user's files): the GPU job, the non-GPU service and the
customer start probes, each stamped with the run's labels and placed on the pool.

Rendering is pure and returns manifests; creating them is the run's job, except for the probes, which
`probes.ProbeLoop` creates.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.gpu_operator import GPU_RESOURCE, holds_driver
from pytest_gpucanary.kube.ownership import OWNER, OWNER_LABEL, RUN_ID_LABEL, fence_toleration, owned_labels
from pytest_gpucanary.ladder.cause import PULL_FAILURES
from pytest_gpucanary.shipped import FIXTURES
from pytest_gpucanary.user_files import read_text, yaml_documents

WORKLOADS = FIXTURES / "workloads"
# How long a pod runs on the local fleet's KWOK nodes (fixtures/fleet/stage-pod-complete.yaml): a Go
# duration from the pod's start, or an RFC 3339 time to run until (kwok's durationFrom takes both)
RUN_DURATION_ANNOTATION = "gpucanary.io/run-duration"
WORK_UNTIL_ENV = "GPUCANARY_WORK_UNTIL_EPOCH_S"  # the GPU job's deadline, Unix seconds (gpu-job.yaml)
PROBE_SCOPE_LABEL = "gpucanary.io/probe-scope"
ROLE_LABEL = "gpucanary.io/role"
IMAGE_PULL_ROLE = "image-pull"
HOLDER_ROLE = "holder"
COLLECTIVE_ROLE = "collective-probe"
COLLECTIVE_LABEL = "gpucanary.io/collective"  # baseline or after: the two ranks of one probe run
RANK_LABEL = "gpucanary.io/rank"
COLLECTIVE_PORT = "29500"  # GPUCANARY_MASTER_PORT unless the manifest sets it
POD_KINDS = ("Pod", "Job", "Deployment", "DaemonSet", "StatefulSet")
SERVICE_KINDS = ("Deployment", "Service", "PodDisruptionBudget")


def load_manifests(path: Path) -> list[dict]:
    docs = yaml_documents(read_text(path, what="workload manifest"), source=f"workload manifest {path}")
    if not docs or not all(isinstance(d, dict) and "kind" in d for d in docs):
        raise ConfigError(f"workload manifest {path} has no Kubernetes objects")
    return docs


@dataclass(frozen=True)
class Placement:
    namespace: str
    run_id: str
    node: str


def _containers(spec: dict) -> list[dict]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _with_images(obj: dict, images: Mapping[str, str]) -> dict:
    """Every container that runs a shipped default image gets the image the run chose for it
    (its override or the mirror); a user's own images stay as they are."""
    if obj.get("kind") in POD_KINDS:
        _, spec = pod_spec(obj)
        for container in _containers(spec):
            container["image"] = images.get(container.get("image", ""), container.get("image", ""))
    return obj


def pod_security(manifests: list[dict]) -> str:
    """The Pod Security level the run's namespace enforces: `baseline`, unless one of its own pods needs the
    host (the local fleet's default service on a kubelet node serves on the host's 127.0.0.1), which only an
    administrator's credentials may run: deploy/admission.yaml refuses the canary's ServiceAccount both."""
    for obj in manifests:
        if obj.get("kind") in POD_KINDS:
            _, spec = pod_spec(obj)
            if (
                any(spec.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
                or any("hostPath" in (v or {}) for v in spec.get("volumes") or [])
                or any((c.get("securityContext") or {}).get("privileged") for c in _containers(spec))
            ):
                return "privileged"
    return "baseline"


def images_of(manifests: list[dict]) -> list[str]:
    """The images the manifests' pods run, each once, in order."""
    found: list[str] = []
    for obj in manifests:
        if obj.get("kind") in POD_KINDS:
            _, spec = pod_spec(obj)
            found += [c["image"] for c in _containers(spec) if c.get("image") and c["image"] not in found]
    return found


# Every canary pod runs at this class's priority: below tenants' default 0, and it never preempts one
# (preemptionPolicy Never), so a probe on a production node waits for a free GPU instead of taking one.
# deploy/priorityclass.yaml is this object; the local fleet creates it; preflight checks that it exists.
PRIORITY_CLASS = "gpucanary-low"
PRIORITY_CLASS_MANIFEST = {
    "apiVersion": "scheduling.k8s.io/v1",
    "kind": "PriorityClass",
    "metadata": {"name": PRIORITY_CLASS, "labels": {OWNER_LABEL: OWNER}},
    "value": -10,
    "preemptionPolicy": "Never",
    "globalDefault": False,
    "description": "gpucanary's probes, jobs and services: below tenants, never preempting them",
}


def _stamp(obj: dict, placement: Placement, role: str) -> dict:
    obj = copy.deepcopy(obj)
    meta = obj.setdefault("metadata", {})
    meta["namespace"] = placement.namespace
    meta.setdefault("labels", {}).update({**owned_labels(placement.run_id), ROLE_LABEL: role})
    spec = obj.get("spec") if obj.get("kind") == "Pod" else ((obj.get("spec") or {}).get("template") or {}).get("spec")
    if isinstance(spec, dict):
        _yield_to_tenants(spec)
        if placement.run_id and fence_toleration(placement.run_id) not in (spec.get("tolerations") or []):
            spec["tolerations"] = [*(spec.get("tolerations") or []), fence_toleration(placement.run_id)]
    return obj


def _yield_to_tenants(spec: dict) -> None:
    spec["priorityClassName"] = PRIORITY_CLASS
    spec.pop("priority", None)  # the admission plugin fills both in from the class
    spec.pop("preemptionPolicy", None)


def pod_spec(obj: dict) -> tuple[dict, dict]:
    """(pod metadata, pod spec) of a Pod or of a workload's pod template."""
    try:
        if obj["kind"] == "Pod":
            return obj.setdefault("metadata", {}), obj["spec"]
        template = obj["spec"]["template"]
        if not isinstance(template.setdefault("metadata", {}), dict) or not template["spec"]["containers"]:
            raise TypeError
        return template["metadata"], template["spec"]
    except (KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"{obj.get('kind')} {obj.get('metadata', {}).get('name', '')!r} has no pod template with containers",
            hint="give spec.template.spec.containers (see fixtures/workloads/)",
        ) from None


def _pin(obj: dict, placement: Placement, role: str) -> dict:
    obj = _stamp(obj, placement, role)
    meta, spec = pod_spec(obj)
    meta.setdefault("labels", {}).update({**owned_labels(placement.run_id), ROLE_LABEL: role})
    spec.setdefault("nodeSelector", {})["kubernetes.io/hostname"] = placement.node
    return obj


def work_until_wall_s(job: dict) -> float | None:
    """The deadline the canary wrote into a GPU job (Unix s), None if it carries none."""
    _, spec = pod_spec(job)
    for container in spec["containers"]:
        for env in container.get("env") or []:
            if env.get("name") == WORK_UNTIL_ENV:
                return float(env["value"])
    return None


def gpu_job(
    path: Path | None,
    placement: Placement,
    *,
    duration_s: float,
    images: Mapping[str, str] | None = None,
    now_wall_s: float | None = None,
) -> dict:
    """The GPU Job, working until now + `duration_s`: the deadline goes into every container's
    environment and, for KWOK, into the pod template's run-duration annotation as an RFC 3339 time,
    so every pod of the Job (a replacement after an eviction too) ends at the same moment."""
    found: list[dict | None] = [d for d in load_manifests(path or WORKLOADS / "gpu-job.yaml") if d["kind"] == "Job"]
    [job] = found or [None]
    if job is None:
        raise ConfigError(f"{path} holds no Job", hint="the GPU workload must be a batch/v1 Job")
    job = _with_images(_pin(job, placement, "gpu-job"), images or {})
    until_s = int((time.time() if now_wall_s is None else now_wall_s) + duration_s)
    meta, spec = pod_spec(job)
    meta.setdefault("annotations", {})[RUN_DURATION_ANNOTATION] = datetime.fromtimestamp(until_s, UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    for container in spec["containers"]:
        env = [e for e in container.get("env") or [] if e.get("name") != WORK_UNTIL_ENV]
        container["env"] = [*env, {"name": WORK_UNTIL_ENV, "value": str(until_s)}]
    return job


def service(path: Path | None, placement: Placement, *, images: Mapping[str, str] | None = None) -> list[dict]:
    docs = load_manifests(path or WORKLOADS / "service.yaml")
    if not any(d["kind"] == "Deployment" for d in docs):
        raise ConfigError(f"{path} holds no Deployment", hint="the service must be a Deployment (+ Service, PDB)")
    if other := [d["kind"] for d in docs if d["kind"] not in SERVICE_KINDS]:
        raise ConfigError(
            f"service manifest {path} holds a {other[0]}: the canary creates only "
            f"{', '.join(SERVICE_KINDS)} for its service (what deploy/rbac.yaml grants)",
            hint="leave the rest out of the manifest",
        )
    return [
        _with_images(_pin(d, placement, "service"), images or {})
        if d["kind"] == "Deployment"
        else _stamp(d, placement, "service")
        for d in docs
    ]


def holder(path: Path, placement: Placement, *, images: Mapping[str, str] | None = None) -> list[dict]:
    """The user's driver holder on the pool node: each workload in the file whose pods get the GPUs from the
    runtime without asking for one (`gpu_operator.holds_driver`)."""
    docs = [d for d in load_manifests(path) if d["kind"] in POD_KINDS and d["kind"] != "Job"]
    if not docs:
        raise ConfigError(
            f"holder manifest {path} has no Pod, Deployment, DaemonSet or StatefulSet",
            hint="a holder runs as long as the run: see fixtures/workloads/holder.yaml",
        )
    if not all(holds_driver(pod_spec(d)[1]) for d in docs):
        raise ConfigError(
            f"holder manifest {path} has a workload whose pods do not hold the driver",
            hint="set NVIDIA_VISIBLE_DEVICES (or runtimeClassName: nvidia) and request no GPU, "
            "as fixtures/workloads/holder.yaml does",
        )
    return [_with_images(_pin(d, placement, HOLDER_ROLE), images or {}) for d in docs]


def probe(
    path: Path | None,
    placement: Placement,
    *,
    scope: str,
    seq: int,
    pool_nodes: tuple[str, ...],
    images: Mapping[str, str] | None = None,
) -> dict:
    found: list[dict | None] = [d for d in load_manifests(path or WORKLOADS / "probe.yaml") if d["kind"] == "Job"]
    [job] = found or [None]
    if job is None:
        raise ConfigError(f"{path} holds no Job", hint="a probe is a short batch/v1 Job")
    job = _with_images(job, images or {})
    if scope == "pool":
        job = _pin(job, placement, "probe")
    else:
        job = _stamp(job, placement, "probe")
        _, spec = pod_spec(job)
        spec["containers"][0].setdefault("resources", {}).setdefault("limits", {})[GPU_RESOURCE] = "1"
        # off every canary pool, not only this run's: a gate runs base and head at once, and the other
        # run's drain would evict a probe that landed on its pool just before the cordon. A pool the
        # canary made is its own from birth; an existing node carved out carries the run's id
        off_pools = [
            {"key": OWNER_LABEL, "operator": "NotIn", "values": [OWNER]},
            {"key": RUN_ID_LABEL, "operator": "DoesNotExist"},
        ]
        if pool_nodes:  # (widen has none: an empty NotIn is invalid)
            off_pools.insert(0, {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": list(pool_nodes)})
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": off_pools}]
                }
            }
        }
    meta, _ = pod_spec(job)
    meta.setdefault("labels", {}).update(
        {**owned_labels(placement.run_id), ROLE_LABEL: "probe", PROBE_SCOPE_LABEL: scope}
    )
    job["metadata"]["name"] = f"probe-{scope}-{seq:04d}"
    job["metadata"]["labels"][PROBE_SCOPE_LABEL] = scope
    return job


def collective_name(when: str, rank: int) -> str:
    return f"collective-{when}-{rank}"


def collective_pod(
    path: Path | None,
    placement: Placement,
    *,
    when: str,
    rank: int,
    node: str,
    master_addr: str,
    images: Mapping[str, str] | None = None,
) -> dict:
    """One rank of the collective probe, on `node`. Rank 0's master address is its own pod IP (the
    downward API) unless the manifest gives one; rank 1 gets `master_addr`, rank 0's IP."""
    found: list[dict | None] = [
        d for d in load_manifests(path or WORKLOADS / "collective-probe.yaml") if d["kind"] == "Pod"
    ]
    [pod] = found or [None]
    if pod is None:
        raise ConfigError(f"{path} holds no Pod", hint="the collective probe is one Pod, run once per rank")
    pod = _with_images(_stamp(pod, placement, COLLECTIVE_ROLE), images or {})
    meta, spec = pod_spec(pod)
    meta["name"] = collective_name(when, rank)
    meta["labels"].update({COLLECTIVE_LABEL: when, RANK_LABEL: str(rank)})
    spec.setdefault("nodeSelector", {})["kubernetes.io/hostname"] = node
    spec["restartPolicy"] = "Never"
    address = (
        {"name": "GPUCANARY_MASTER_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        if rank == 0
        else {"name": "GPUCANARY_MASTER_ADDR", "value": master_addr}
    )
    for container in spec["containers"]:
        own = [e for e in container.get("env") or [] if e.get("name") != "GPUCANARY_RANK"]
        names = {e.get("name") for e in own}
        added = [
            e
            for e in (
                address,
                {"name": "GPUCANARY_WORLD_SIZE", "value": "2"},
                {"name": "GPUCANARY_MASTER_PORT", "value": COLLECTIVE_PORT},
            )
            if e["name"] not in names
        ]
        container["env"] = [*own, *added, {"name": "GPUCANARY_RANK", "value": str(rank)}]
    return pod


def rendered(settings: Settings, placement: Placement, *, service_path: Path | None = None) -> list[dict]:
    """Every workload the run places, rendered (the GPU job, the service's objects, one probe); the service from
    `service_path` where the pool brings its own."""
    images = settings.images()
    return [
        gpu_job(settings.gpu_job, placement, duration_s=settings.job_duration_s, images=images),
        *service(settings.service or service_path, placement, images=images),
        *(holder(settings.holder, placement, images=images) if settings.holder else ()),
        probe(settings.probe, placement, scope="fleet", seq=0, pool_nodes=(placement.node,), images=images),
    ]


def check(settings: Settings) -> None:
    """Render every workload once, before the cluster is touched: a missing or malformed manifest is one line."""
    placement = Placement("gpucanary-check", "check", "check-node")
    rendered(settings, placement)
    collective_pod(
        settings.collective_probe,
        placement,
        when="check",
        rank=0,
        node="check-node",
        master_addr="",
        images=settings.images(),
    )


def image_pull_pod(image: str, placement: Placement, *, index: int) -> dict:
    """A pod on the pool node that only makes the node pull `image`: pulled once its container ran or
    ended (with any exit code, so an image without a shell is fine too); never a GPU."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"image-pull-{index}",
            "namespace": placement.namespace,
            "labels": {**owned_labels(placement.run_id), ROLE_LABEL: IMAGE_PULL_ROLE},
            "annotations": {RUN_DURATION_ANNOTATION: "1s"},
        },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "priorityClassName": PRIORITY_CLASS,
            "nodeSelector": {"kubernetes.io/hostname": placement.node},
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "pull",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sh", "-c", "exit 0"],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                }
            ],
        },
    }


def pull_state(pod: dict) -> tuple[bool | None, str]:
    """(True: pulled; False: cannot be pulled; None: not yet), with the kubelet's words."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        state = status.get("state") or {}
        if "running" in state or "terminated" in state:
            return True, "pulled"
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in PULL_FAILURES:
            return False, f"{waiting['reason']}: {' '.join(str(waiting.get('message', '')).split())[:200]}"
    if (pod.get("status") or {}).get("phase") in ("Running", "Succeeded"):
        return True, "pulled"
    return None, (pod.get("status") or {}).get("phase") or "Pending"
