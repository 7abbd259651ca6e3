"""The canary's workloads from fixtures/ (or the user's files): the GPU job, the non-GPU service and the
customer start probes, each stamped with the run's labels and placed on the pool; and `ProbeLoop`,
which creates probe Jobs at a fixed cadence through the whole change.

Rendering is pure and returns manifests; creating them is the run's job, except for the probes. Each
tick creates one pool probe Job (pinned to the pool node: when can new work land there again?) and
one fleet probe Job (one GPU on any other node: does the fleet keep starting work?). Their latencies
come from the recorder's pod stream, not from polling; the Jobs finish by themselves.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.config import FIXTURES, Settings, read_text, yaml_documents
from pytest_gpucanary.errors import ConfigError, GpucanaryError
from pytest_gpucanary.gpu_operator import GPU_RESOURCE
from pytest_gpucanary.kube import Kube, owned_labels
from pytest_gpucanary.ladder import timeline
from pytest_gpucanary.ladder.model import ProbeSeen
from pytest_gpucanary.ladder.timeline import Record

WORKLOADS = FIXTURES / "workloads"
RUN_DURATION_ANNOTATION = "gpucanary.io/run-duration"
PROBE_SCOPE_LABEL = "gpucanary.io/probe-scope"
ROLE_LABEL = "gpucanary.io/role"


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


def _stamp(obj: dict, placement: Placement, role: str) -> dict:
    obj = copy.deepcopy(obj)
    meta = obj.setdefault("metadata", {})
    meta["namespace"] = placement.namespace
    meta.setdefault("labels", {}).update({**owned_labels(placement.run_id), ROLE_LABEL: role})
    return obj


def _pod_spec(obj: dict) -> tuple[dict, dict]:
    """(pod metadata, pod spec) of a Pod or of a workload's pod template."""
    try:
        if obj["kind"] == "Pod":
            return obj.setdefault("metadata", {}), obj["spec"]
        template = obj["spec"]["template"]
        if not isinstance(template.setdefault("metadata", {}), dict) or not template["spec"]["containers"]:
            raise TypeError
        return template["metadata"], template["spec"]
    except (KeyError, TypeError, AttributeError):
        raise ConfigError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name', '')!r} has no pod template "
                          "with containers", hint="give spec.template.spec.containers (see fixtures/workloads/)") from None


def _pin(obj: dict, placement: Placement, role: str) -> dict:
    obj = _stamp(obj, placement, role)
    meta, spec = _pod_spec(obj)
    meta.setdefault("labels", {}).update({**owned_labels(placement.run_id), ROLE_LABEL: role})
    spec.setdefault("nodeSelector", {})["kubernetes.io/hostname"] = placement.node
    return obj


def gpu_job(path: Path | None, placement: Placement, *, duration_s: float) -> dict:
    [job] = [d for d in load_manifests(path or WORKLOADS / "gpu-job.yaml") if d["kind"] == "Job"] or [None]
    if job is None:
        raise ConfigError(f"{path} holds no Job", hint="the GPU workload must be a batch/v1 Job")
    job = _pin(job, placement, "gpu-job")
    meta, _ = _pod_spec(job)
    meta.setdefault("annotations", {})[RUN_DURATION_ANNOTATION] = f"{int(duration_s)}s"
    return job


def service(path: Path | None, placement: Placement) -> list[dict]:
    docs = load_manifests(path or WORKLOADS / "service.yaml")
    if not any(d["kind"] == "Deployment" for d in docs):
        raise ConfigError(f"{path} holds no Deployment", hint="the service must be a Deployment (+ Service, PDB)")
    return [_pin(d, placement, "service") if d["kind"] == "Deployment" else _stamp(d, placement, "service")
            for d in docs]


def probe(path: Path | None, placement: Placement, *, scope: str, seq: int, pool_nodes: tuple[str, ...]) -> dict:
    [job] = [d for d in load_manifests(path or WORKLOADS / "probe.yaml") if d["kind"] == "Job"] or [None]
    if job is None:
        raise ConfigError(f"{path} holds no Job", hint="a probe is a short batch/v1 Job")
    if scope == "pool":
        job = _pin(job, placement, "probe")
    else:
        job = _stamp(job, placement, "probe")
        _, spec = _pod_spec(job)
        spec["containers"][0].setdefault("resources", {}).setdefault("limits", {})[GPU_RESOURCE] = "1"
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": list(pool_nodes)}]}]}}}
    meta, _ = _pod_spec(job)
    meta.setdefault("labels", {}).update({**owned_labels(placement.run_id), ROLE_LABEL: "probe", PROBE_SCOPE_LABEL: scope})
    job["metadata"]["name"] = f"probe-{scope}-{seq:04d}"
    job["metadata"]["labels"][PROBE_SCOPE_LABEL] = scope
    return job


def check(settings: Settings) -> None:
    """Render every workload once, before the cluster is touched: a missing or malformed manifest is one line."""
    placement = Placement("gpucanary-check", "check", "check-node")
    gpu_job(settings.gpu_job, placement, duration_s=settings.job_duration_s)
    service(settings.service, placement)
    probe(settings.probe, placement, scope="fleet", seq=0, pool_nodes=("check-node",))


class ProbeLoop:
    def __init__(self, kube: Kube, placement: Placement, *, manifest: Path | None, interval_s: float,
                 pool_nodes: tuple[str, ...], scopes: tuple[str, ...] = ("pool", "fleet")) -> None:
        self.kube, self.placement, self.manifest, self.pool_nodes = kube, placement, manifest, pool_nodes
        self.interval_s, self.scopes = interval_s, scopes
        self.created: dict[str, tuple[str, int]] = {}   # name -> (scope, created_wall_ns)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpucanary-probes", daemon=True)

    def start(self) -> ProbeLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            for scope in self.scopes:
                job = probe(self.manifest, self.placement, scope=scope, seq=seq, pool_nodes=self.pool_nodes)
                created_wall_ns = time.time_ns()  # before the call, so no watch event can precede it
                try:
                    self.kube.create(job)
                    self.created[job["metadata"]["name"]] = (scope, created_wall_ns)
                except GpucanaryError as err:
                    self.errors.append(str(err))
            seq += 1
            self._stop.wait(self.interval_s)

    def results(self, records: list[Record]) -> list[ProbeSeen]:
        return timeline.probes_seen(records, dict(self.created), namespace=self.placement.namespace)  # dict(): the loop adds
