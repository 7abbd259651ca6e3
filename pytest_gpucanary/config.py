"""One typed settings object. Every knob has one name: `--gpucanary-<name>` on the command line,
`gpucanary_<name>` in the ini file, `GPUCANARY_<NAME>` in the environment, `Settings.<name>` here.
Precedence: command line > ini > environment > default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from pytest_gpucanary.errors import ConfigError


@dataclass(frozen=True)
class Knob:
    name: str
    type: type
    default: Any
    help: str

    @property
    def env(self) -> str:
        return "GPUCANARY_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--gpucanary-" + self.name.replace("_", "-")


KNOBS = (
    Knob("kubeconfig", Path, None, "Kubeconfig of a real cluster; without it the local fleet is the target"),
    Knob("context", str, None, "Context in the kubeconfig"),
    Knob("policy", Path, None, "Upgrade policy under test: ClusterPolicy, NVIDIADriver or Helm values YAML"),
    Knob("driver_version", str, None, "Driver version to upgrade the canary pool to"),
    Knob("pool_provider", str, None, "Pool provider: kwok (local fleet default) or existing (real clusters)"),
    Knob("pool_node", str, None, "Existing GPU node to carve out as the pool (provider existing)"),
    Knob("pool_selector", str, None, "Label selector picking existing GPU nodes for the pool (provider existing)"),
    Knob("pool_size", int, 1, "Number of nodes in the pool"),
    Knob("allow_foreign_pods", bool, False, "Accept a pool node that runs pods the canary did not put there"),
    Knob("gpu_job", Path, None, "Manifest of the representative GPU Job (default fixtures/workloads/gpu-job.yaml)"),
    Knob("service", Path, None, "Manifest of the non-GPU service (default fixtures/workloads/service.yaml)"),
    Knob("probe", Path, None, "Manifest of a customer start probe pod (default fixtures/workloads/probe.yaml)"),
    Knob("probe_interval_s", float, 15.0, "Seconds between customer start probes"),
    Knob("job_duration_s", float, 600.0, "How long the representative GPU job runs (it must span the upgrade)"),
    Knob("upgrade_budget_s", float, 1200.0, "Time budget for the pool to reach upgrade-done"),
    Knob("max_queue_delay_s", float, 300.0, "Longest a pool probe may wait to be scheduled"),
    Knob("max_start_latency_s", float, 60.0, "Longest p99 start latency of fleet-wide probes"),
    Knob("allowed_evictions", str, "gpu", "Pods the policy may evict: gpu (pods requesting GPUs) or a label selector"),
    Knob("allow_inconclusive", bool, False, "Let inconclusive stages pass the gate"),
    Knob("service_url", str, None, "URL of the non-GPU service under load (local fleet: its ingress)"),
    Knob("load_users", int, 10, "Simulated users of the service (locust, out of process)"),
    Knob("load_spawn_rate", float, 10.0, "Users started per second"),
    Knob("load_workers", int, 0, "Locust worker processes (0: one process; N: one master and N workers)"),
    Knob("locustfile", Path, None, "Locustfile for the service load (default fixtures/load/locustfile.py)"),
    Knob("max_error_ratio", float, 0.01, "Highest failed-request ratio of the service in any upgrade phase (0..1)"),
    Knob("max_p99_s", float, 1.0, "Highest p99 request latency of the service in any upgrade phase"),
    Knob("prometheus_url", str, None, "Prometheus with operator and DCGM metrics (local fleet: its own)"),
    Knob("reports_dir", Path, Path("reports"), "Directory for launch receipts (one sub-directory per run)"),
    Knob("run_id", str, None, "Run id (default: generated); names and labels every object the canary creates"),
)
BY_NAME = {knob.name: knob for knob in KNOBS}


def convert(knob: Knob, raw: Any) -> Any:
    if raw is None or isinstance(raw, knob.type):
        return raw
    text = str(raw).strip()
    try:
        if knob.type is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(text)
        return knob.type(text)
    except ValueError:
        raise ConfigError(f"{knob.flag}={text!r} is not a valid {knob.type.__name__}",
                          hint=f"also settable as ini {'gpucanary_' + knob.name} or env {knob.env}") from None


@dataclass(frozen=True)
class Settings:
    kubeconfig: Path | None = None
    context: str | None = None
    policy: Path | None = None
    driver_version: str | None = None
    pool_provider: str | None = None
    pool_node: str | None = None
    pool_selector: str | None = None
    pool_size: int = 1
    allow_foreign_pods: bool = False
    gpu_job: Path | None = None
    service: Path | None = None
    probe: Path | None = None
    probe_interval_s: float = 15.0
    job_duration_s: float = 600.0
    upgrade_budget_s: float = 1200.0
    max_queue_delay_s: float = 300.0
    max_start_latency_s: float = 60.0
    allowed_evictions: str = "gpu"
    allow_inconclusive: bool = False
    service_url: str | None = None
    load_users: int = 10
    load_spawn_rate: float = 10.0
    load_workers: int = 0
    locustfile: Path | None = None
    max_error_ratio: float = 0.01
    max_p99_s: float = 1.0
    prometheus_url: str | None = None
    reports_dir: Path = Path("reports")
    run_id: str | None = None

    @classmethod
    def resolve(cls, *sources: Callable[[Knob], Any]) -> Settings:
        """The first source that answers (not None) wins, knob by knob."""
        values = {}
        for knob in KNOBS:
            raw = next((v for source in sources if (v := source(knob)) is not None), knob.default)
            values[knob.name] = convert(knob, raw)
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        return cls.resolve(env_source(environ))

    def validate(self) -> None:
        if self.pool_provider not in (None, "kwok", "existing"):
            raise ConfigError(f"unknown pool provider {self.pool_provider!r}", hint="use kwok or existing")
        if self.pool_size < 1:
            raise ConfigError(f"--gpucanary-pool-size={self.pool_size} must be at least 1")
        if not 0 <= self.max_error_ratio <= 1:
            raise ConfigError(f"--gpucanary-max-error-ratio={self.max_error_ratio} must be a fraction 0..1")
        if self.load_users < 0 or self.load_workers < 0:
            raise ConfigError("--gpucanary-load-users and --gpucanary-load-workers must not be negative")
        for name in ("probe_interval_s", "job_duration_s", "upgrade_budget_s", "max_queue_delay_s",
                     "max_start_latency_s", "load_spawn_rate", "max_p99_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{BY_NAME[name].flag}={getattr(self, name)} must be positive")

    def require_gate_inputs(self) -> None:
        """What a canary run cannot start without; checked before the cluster is touched."""
        if self.policy is None:
            raise ConfigError("no upgrade policy given", hint="pass --gpucanary-policy PATH")
        if not self.driver_version:
            raise ConfigError("no target driver version given", hint="pass --gpucanary-driver-version VERSION")


def env_source(environ: Mapping[str, str]) -> Callable[[Knob], Any]:
    return lambda knob: environ.get(knob.env) or None

