"""Every knob, declared once, as a field of `Settings`.

From each field derive: the flag `--gpucanary-<name>`, the ini key `gpucanary_<name>`, the environment
variable `GPUCANARY_<NAME>`, the default, the type conversion, the validation and the help text;
the ladder's thresholds are the fields marked `threshold`. Precedence: command line > ini >
environment > default, as a chain of sources (`Settings.resolve`). Messages that name an option get
its spelling from `flag()`. Each field's check of its value is in `checks`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpucanary.checks import (
    at_least,
    evictions_rule,
    fraction,
    image_rule,
    one_of,
    positive,
    registry_rule,
    run_id_rule,
    selector,
    url_rule,
    version_rule,
    xid_list,
)
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.knobs import Knob, check_all, env_source, knob, knobs_of, resolve_values

# The default workloads' images, public and pinned; fixtures/workloads/*.yaml name the same ones and
# say where each tag was checked as published. A mirror serves each under its own path.
GPU_JOB_IMAGE = "nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0-ubuntu22.04"
SERVICE_IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.63.0"
PROBE_IMAGE = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
COLLECTIVE_IMAGE = "nvcr.io/nvidia/pytorch:26.01-py3"


def mirrored(image: str, registry: str) -> str:
    """`nvcr.io/nvidia/x:1` with registry `mirror:5000/gpu` -> `mirror:5000/gpu/nvidia/x:1` (the path is kept)."""
    first, _, rest = image.partition("/")
    if not rest or not ("." in first or ":" in first or first == "localhost"):
        first, rest = "docker.io", image if "/" in image else f"library/{image}"
    return f"{registry.rstrip('/')}/{rest}"


@dataclass(frozen=True)
class Settings:
    kubeconfig: Path | None = knob(None, "Kubeconfig of a real cluster; without it the local fleet is the target")
    context: str | None = knob(None, "Context in the kubeconfig")
    policy: Path | None = knob(None, "Upgrade policy under test: ClusterPolicy, NVIDIADriver or Helm values YAML")
    # Helm values become the ClusterPolicy the chart renders (policy/helm.py); a CR needs neither
    helm_chart: Path | None = knob(
        None,
        "GPU Operator chart (directory or .tgz) that renders a Helm values policy (local fleet: its release's chart)",
    )
    helm_binary: Path | None = knob(
        None,
        "Helm binary that renders a Helm values policy (default: helm on PATH, else the build of ci/build-helm.sh)",
    )
    driver_version: str | None = knob(None, "Driver version to upgrade the canary pool to", check=version_rule)
    pool_provider: str | None = knob(
        None,
        "Pool provider: kubelet (the local fleet's real node, its default), kwok "
        "(a fresh simulated node of the local fleet) or existing (real clusters)",
        check=one_of("kubelet", "kwok", "existing"),
    )
    pool_node: str | None = knob(None, "Existing GPU node to carve out as the pool (provider existing)")
    pool_selector: str | None = knob(
        None, "Label selector picking existing GPU nodes for the pool (provider existing)", check=selector
    )
    pool_size: int = knob(1, "Number of nodes in the pool", check=at_least(1))
    allow_foreign_pods: bool = knob(False, "Accept a pool node that runs pods the canary did not put there")
    allow_shared_policy: bool = knob(
        False,
        "NVIDIADriver mode before operator v26.7 (the upgradePolicy is the "
        "ClusterPolicy's, cluster-wide): run although another NVIDIADriver's "
        "nodes are mid-upgrade, which then go on under the policy under test",
    )
    gpu_job: Path | None = knob(
        None, "Manifest of the representative GPU Job (default fixtures/workloads/gpu-job.yaml)"
    )
    service: Path | None = knob(None, "Manifest of the non-GPU service (default fixtures/workloads/service.yaml)")
    probe: Path | None = knob(None, "Manifest of a customer start probe pod (default fixtures/workloads/probe.yaml)")
    collective_probe: Path | None = knob(
        None,
        "Manifest of the collective probe pod, run on two nodes across the "
        "upgrade boundary (default fixtures/workloads/collective-probe.yaml)",
    )
    holder: Path | None = knob(
        None,
        "Manifest of a workload that holds the driver without a GPU request "
        "(NVIDIA_VISIBLE_DEVICES or RuntimeClass nvidia), placed on the pool with the "
        "others to show what the policy does with such pods (fixtures/workloads/"
        "holder.yaml is one; default none; not on a kwok pool, whose driver is simulated)",
    )
    peer_node: str | None = knob(
        None,
        "Node outside a one-node pool for the collective probe (default on the local "
        "fleet: the first Ready, schedulable GPU node on the pool's driver with a free "
        "GPU, whose taints the probe tolerates and that no run holds; on a real "
        "cluster: none unless named; none: no peer probe)",
    )
    collective_timeout_s: float = knob(
        300.0, "Longest the collective probe may run once both ranks started", check=positive
    )
    min_busbw_ratio: float = knob(
        0.8,
        "Lowest bus bandwidth of the collective probe after the upgrade, as a fraction of its baseline (0..1)",
        check=fraction,
        threshold=True,
    )
    probe_interval_s: float = knob(15.0, "Seconds between customer start probes", check=positive)
    baseline_s: float = knob(
        30.0, "Seconds of load and probes before the policy is applied (the before phase)", check=positive
    )
    # from its creation: 30 s of baseline plus a whole upgrade (about 50 s on operator v25.3.4, about
    # 140 s on v26.x on the local fleet) plus a margin; a replacement pod after an eviction works on
    # until the same deadline, so the run waits for the job's completion at most this long plus a grace
    job_duration_s: float = knob(
        210.0,
        "Seconds of GPU work the representative GPU job does, counted from its creation (it must span the upgrade)",
        check=positive,
    )
    # validation alone may take 600 s (fixed in the operator), so the budget leaves room beyond it
    upgrade_budget_s: float = knob(
        1200.0, "Time budget for the pool to reach upgrade-done", check=positive, threshold=True
    )
    # pull failures and crash loops are called by the kubelet's retries (ladder/cause.py), the rest by this
    stall_s: float = knob(
        180.0,
        "How long a stuck pool node state may last before the run calls it, not waiting "
        "out the budget: an operator pod unschedulable or without its sandbox, the node NotReady, an operand held "
        "behind a Ready driver, a container short of its startup probe whose log has gone "
        "quiet, an eviction a PodDisruptionBudget refuses with no timeoutSeconds",
        check=positive,
        threshold=True,
    )
    # from the driver manager pausing the device plugin to its return with the new driver; a driver
    # built on the node (not precompiled) compiles its kernel modules in that window
    max_gpus_gone_s: float = knob(
        900.0,
        "Longest a pool node's GPUs may be gone from allocatable during its upgrade",
        check=positive,
        threshold=True,
    )
    # pool probes wait out the cordon: cordon to uncordon
    max_queue_delay_s: float = knob(
        300.0, "Longest a pool probe may wait to be scheduled", check=positive, threshold=True
    )
    max_start_latency_s: float = knob(
        60.0, "Longest p99 start latency of fleet-wide probes", check=positive, threshold=True
    )
    min_probe_samples: int = knob(
        3,
        "Fewest probes of each scope a scheduler verdict needs (fewer: inconclusive)",
        check=at_least(1),
        threshold=True,
    )
    allowed_evictions: str = knob(
        "gpu",
        "Pods the policy may evict: gpu (pods requesting GPUs) or a label selector",
        check=evictions_rule,
        threshold=True,
    )
    allowed_xids: str = knob(
        "",
        "XID codes the device stage tolerates on the pool, comma-separated (e.g. 13,31,43: errors an application "
        "causes); any other XID fails it",
        check=xid_list,
        threshold=True,
    )
    allow_inconclusive: bool = knob(False, "Let inconclusive stages pass the gate", threshold=True)
    service_url: str | None = knob(
        None, "URL of the non-GPU service under load (local fleet: its ingress)", check=url_rule
    )
    load_users: int = knob(10, "Simulated users of the service (locust, out of process)", check=at_least(0))
    load_spawn_rate: float = knob(10.0, "Users started per second", check=positive)
    load_workers: int = knob(
        0, "Locust worker processes (0: one process; N: one master and N workers)", check=at_least(0)
    )
    # each default workload image, and the registry they come from; a mirror keeps each image's path
    image_registry: str | None = knob(
        None,
        "Registry (host[:port][/path]) that replaces the registry of every "
        "default workload image, for air-gapped mirrors",
        check=registry_rule,
    )
    gpu_job_image: str | None = knob(None, f"Image of the default GPU job (default {GPU_JOB_IMAGE})", check=image_rule)
    service_image: str | None = knob(
        None, f"Image of the default non-GPU service (default {SERVICE_IMAGE})", check=image_rule
    )
    probe_image: str | None = knob(None, f"Image of the default start probe (default {PROBE_IMAGE})", check=image_rule)
    collective_image: str | None = knob(
        None, f"Image of the default collective probe (default {COLLECTIVE_IMAGE})", check=image_rule
    )
    # a CUDA image is gigabytes: a cold node may take minutes to pull it
    image_pull_timeout_s: float = knob(
        600.0, "Longest the pool node may take to pull each workload image", check=positive
    )
    locustfile: Path | None = knob(None, "Locustfile for the service load (default fixtures/load/locustfile.py)")
    max_error_ratio: float = knob(
        0.01, "Highest failed-request ratio of the service in any upgrade phase (0..1)", check=fraction, threshold=True
    )
    max_p99_s: float = knob(
        1.0, "Highest p99 request latency of the service in any upgrade phase", check=positive, threshold=True
    )
    min_phase_requests: int = knob(
        50,
        "Fewest service requests an upgrade phase needs to be judged (fewer: inconclusive)",
        check=at_least(1),
        threshold=True,
    )
    prometheus_url: str | None = knob(
        None, "Prometheus with operator and DCGM metrics (local fleet: its own)", check=url_rule
    )
    pushgateway_url: str | None = knob(
        None,
        "Prometheus Pushgateway that each finished run pushes its verdict's "
        "metrics to (the receipt's verdict.prom has them too)",
        check=url_rule,
    )
    reports_dir: Path = knob(Path("reports"), "Directory for launch receipts (one sub-directory per run)")
    run_id: str | None = knob(
        None, "Run id (default: generated); names and labels every object the canary creates", check=run_id_rule
    )
    fleet_keep: bool = knob(False, "Leave the local fleet running after the session")

    def __post_init__(self) -> None:
        check_all(self, KNOBS)

    @classmethod
    def resolve(cls, *sources: Callable[[Knob], Any]) -> Settings:
        """The first source that answers (not None) wins, knob by knob."""
        return cls(**resolve_values(KNOBS, sources))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        return cls.resolve(env_source(environ))

    @property
    def inconclusive_fails(self) -> bool:
        return not self.allow_inconclusive

    def xids_allowed(self) -> frozenset[int]:
        return frozenset(int(p) for p in self.allowed_xids.split(",") if p.strip())

    def longest_run_s(self) -> float:
        """A run's worst case: every image pull, the baseline, the upgrade budget for the rollout and once
        more for the restore's waits, and 10 minutes for the phases and waits around them."""
        return self.image_pull_timeout_s + self.baseline_s + 2 * self.upgrade_budget_s + 600

    def thresholds(self) -> dict[str, Any]:
        """The knobs the ladder judges with, by name (what a receipt records)."""
        return {k.name: getattr(self, k.name) for k in KNOBS if k.threshold}

    def with_thresholds(self, values: Mapping[str, Any]) -> Settings:
        unknown = set(values) - {k.name for k in KNOBS if k.threshold}
        if unknown:
            raise ConfigError(
                f"unknown threshold(s) {sorted(unknown)}",
                hint=f"thresholds are {', '.join(k.name for k in KNOBS if k.threshold)}",
            )
        return dataclasses.replace(self, **{name: BY_NAME[name].convert(v) for name, v in values.items()})

    def images(self) -> dict[str, str]:
        """Each default workload image -> the image this run uses for it (its knob, else the mirror)."""
        chosen = {
            GPU_JOB_IMAGE: self.gpu_job_image,
            SERVICE_IMAGE: self.service_image,
            PROBE_IMAGE: self.probe_image,
            COLLECTIVE_IMAGE: self.collective_image,
        }
        return {
            default: override or (mirrored(default, self.image_registry) if self.image_registry else default)
            for default, override in chosen.items()
        }

    def require_gate_inputs(self) -> None:
        """What a canary run cannot start without; checked before the cluster is touched."""
        if self.policy is None:
            raise ConfigError("no upgrade policy given", hint=f"pass {flag('policy')} PATH")
        if not self.driver_version:
            raise ConfigError("no target driver version given", hint=f"pass {flag('driver_version')} VERSION")
        _writable_dir(self.reports_dir, flag("reports_dir"))


KNOBS = knobs_of(Settings)
BY_NAME = {k.name: k for k in KNOBS}


def flag(name: str) -> str:
    """The command-line spelling of a knob, for messages: flag('pool_node') -> --gpucanary-pool-node."""
    return BY_NAME[name].flag


def _writable_dir(path: Path, option: str) -> None:
    """The directory exists or can be made, and a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".gpucanary-write-check-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"{option}={str(path)!r} is not a writable directory ({err.strerror or err})",
            hint="point it at a directory the run may write its receipts into",
        ) from None


DEFAULTS = Settings()
