"""Where the local fleet keeps its state, and which loopback ports it uses.

The fleet directory holds everything a running fleet owns (PKI, kubeconfig, etcd data, logs, pid
files). Every process's command line names a path inside it, which is how `down` finds orphans.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.knobs import check_all, env_source, knob, knobs_of, resolve_values

HOST = "127.0.0.1"
DEFAULT_PORT_BASE = 26400
DEFAULT_GPU_NODES = 4
DEFAULT_KUBELET_NODES = 1
MAX_KUBELET_NODES = 8
MAX_GPU_NODES = 1000  # measured on 2 cores (docs/measurements.md); KWOK itself holds more
# The GPU Operator releases the fleet can build and run (ci/build-operator.sh), newest first.
OPERATOR_RELEASES = ("v26.7.0", "v26.3.3", "v25.10.1", "v25.3.4")
DEFAULT_OPERATOR_RELEASE = OPERATOR_RELEASES[0]
# The driver manager on a kubelet pool node reaches the apiserver on 127.0.0.1 only on the host's network:
# the NVIDIADriver's and the ClusterPolicy's driver.hostNetwork came in v26.3.
KUBELET_POOL_RELEASES = ("v26.7.0", "v26.3.3")
# A default NVIDIADriver (spec.default: the driver of every GPU node no other NVIDIADriver picks) came in v26.7.
DEFAULT_NVIDIADRIVER_RELEASES = ("v26.7.0",)
GPU_CLUSTER_RELEASES = ("v26.7.0",)  # GPUCluster is new in v26.7

# Offsets from the port base; the fixed layout makes a port clash easy to name in an error.
PORT_OFFSETS = {
    "etcd": 79,
    "etcd-peer": 80,
    "kube-apiserver": 43,
    "kube-controller-manager": 57,
    "kube-scheduler": 59,
    "kwok": 50,
    "prometheus": 90,
    "gpu-operator-metrics": 81,
    "gpu-operator-health": 82,
    "node-agent": 83,
    "ingress": 84,
}

# Each real kubelet node i takes offsets KUBELET_NODE_OFFSET + i * len(KUBELET_NODE_PORTS) + k;
# hostNetwork workloads on those nodes bind the workload ports (tests use them).
KUBELET_NODE_OFFSET = 0
KUBELET_NODE_PORTS = ("kubelet", "kubelet-healthz", "containerd-metrics", "containerd-stream")
KUBELET_WORKLOAD_OFFSETS = (40, 41, 42)
# The canary's default service on kubelet pool node i binds KUBELET_SERVICE_OFFSET + i (hostNetwork).
KUBELET_SERVICE_OFFSET = 60


def _default_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "gpucanary" / "fleet"


def _within(low: int, high: int, low_means: str = "") -> Callable[[int], str | None]:
    low_text = f"{low} ({low_means})" if low_means else str(low)
    return lambda value: None if low <= value <= high else f"is out of range; use {low_text} to {high}"


def _release(value: str) -> str | None:
    if value in OPERATOR_RELEASES:
        return None
    return "is not a release the fleet can run; use one of " + ", ".join(OPERATOR_RELEASES)


def _driver_mode(value: str) -> str | None:
    return None if value in ("nvidiadriver", "clusterpolicy") else "is unknown; use nvidiadriver or clusterpolicy"


@dataclass(frozen=True)
class FleetSettings:
    """The fleet's settings, each from its environment variable (`GPUCANARY_<NAME>`), declared and checked as
    the run's own are (knobs.py)."""

    fleet_dir: Path | None = knob(
        None, "Where the fleet keeps its state (default $XDG_STATE_HOME/gpucanary/fleet)", env_only=True
    )
    fleet_port_base: int = knob(
        DEFAULT_PORT_BASE, "First of the fleet's 127.0.0.1 ports", check=_within(1024, 61000), env_only=True
    )
    fleet_gpu_nodes: int = knob(DEFAULT_GPU_NODES, "KWOK GPU nodes", check=_within(1, MAX_GPU_NODES), env_only=True)
    fleet_driver_mode: str = knob(
        "nvidiadriver",
        "nvidiadriver (an NVIDIADriver per driver) or clusterpolicy (one driver DaemonSet for every GPU node)",
        check=_driver_mode,
        env_only=True,
    )
    operator_release: str = knob(
        DEFAULT_OPERATOR_RELEASE, "The GPU Operator release the fleet builds and runs", check=_release, env_only=True
    )
    fleet_kubelet_nodes: int = knob(
        DEFAULT_KUBELET_NODES,
        "Real kubelet GPU nodes",
        check=_within(0, MAX_KUBELET_NODES, "none"),
        env_only=True,
    )
    fleet_gpu_rdma: bool = knob(False, "GPUDirect RDMA on (driver.rdma with host MOFED)", env_only=True)
    fleet_kubelet_pool: bool | None = knob(
        None, "The kubelet nodes are canary pools (default: where the mode and release allow)", env_only=True
    )
    fleet_default_nvidiadriver: bool | None = knob(
        None, "The fleet's NVIDIADriver is the default one (default: on v26.7)", env_only=True
    )
    fleet_dra: bool = knob(
        False,
        "GPUCluster mode (v26.7): the operator deploys NVIDIA's DRA driver and DRA validator, no device plugin, and "
        "the KWOK GPU nodes offer their GPUs as gpu.nvidia.com ResourceSlices while the plugin pod is Ready on a "
        "loaded driver (the node agent's); on kubelet nodes NVIDIA's DRA kubelet plugin runs, under containerd 2",
        env_only=True,
    )

    cache: Path | None = knob(
        None,
        "The build cache root (default ~/.cache/gpucanary); an installed package finds the builds there",
        env_only=True,
    )
    # prebuilt binaries instead of the cached builds of ci/build*.sh (an operator directory must hold the release)
    bin_dir: Path | None = knob(None, "Prebuilt control plane binaries instead of ci/build.sh's", env_only=True)
    operator_bin_dir: Path | None = knob(
        None, "A prebuilt GPU Operator of the chosen release instead of ci/build-operator.sh's", env_only=True
    )
    kubelet_bin_dir: Path | None = knob(
        None, "Prebuilt kubelet node binaries instead of ci/build-kubelet.sh's", env_only=True
    )
    nvml_shim_dir: Path | None = knob(
        None, "A prebuilt NVML stand-in instead of ci/build-nvml-shim.sh's", env_only=True
    )
    nfd_master_dir: Path | None = knob(None, "A prebuilt nfd-master instead of ci/build-nfd-master.sh's", env_only=True)
    device_plugin_dir: Path | None = knob(
        None, "A prebuilt NVIDIA device plugin and GFD instead of ci/build-device-plugin.sh's", env_only=True
    )
    dra_driver_dir: Path | None = knob(
        None, "A prebuilt NVIDIA DRA kubelet plugin instead of ci/build-dra-driver.sh's", env_only=True
    )
    containerd_dir: Path | None = knob(
        None, "A prebuilt containerd 2 instead of ci/build-containerd.sh's", env_only=True
    )

    def __post_init__(self) -> None:
        check_all(self, FLEET_KNOBS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FleetSettings:
        return cls(**resolve_values(FLEET_KNOBS, (env_source(environ),)))


FLEET_KNOBS = knobs_of(FleetSettings)


@dataclass(frozen=True)
class FleetLayout:
    root: Path
    port_base: int = DEFAULT_PORT_BASE
    gpu_nodes: int = DEFAULT_GPU_NODES
    driver_mode: str = "nvidiadriver"  # or "clusterpolicy": one driver DaemonSet for every GPU node
    operator_release: str = DEFAULT_OPERATOR_RELEASE
    kubelet_nodes: int = DEFAULT_KUBELET_NODES  # real kubelet nodes (0 disables them)
    # the kubelet nodes are canary pools (the default pool of a run on the fleet): the operator's
    # driver (with its driver manager), validator and device plugin run there, from local stand-in
    # images; otherwise a fleet process is their device plugin and no operand runs there
    kubelet_pool: bool = False
    gpu_rdma: bool = False  # GPUDirect RDMA on (driver.rdma with host MOFED): peermem in every driver pod
    # NVIDIADriver mode: the fleet's own NVIDIADriver is the default one (no nodeSelector), as clusters run
    # after moving from ClusterPolicy to NVIDIADriver; canary pools keep NVIDIADrivers of their own
    default_driver: bool = False
    # GPUCluster mode: NVIDIA's DRA driver instead of the device plugin; the KWOK GPU nodes' GPUs as gpu.nvidia.com
    # ResourceSlices (the node agent's)
    dra: bool = False

    @classmethod
    def from_env(cls) -> FleetLayout:
        settings = FleetSettings.from_env()
        layout = cls(
            root=(settings.fleet_dir or _default_dir()).expanduser().resolve(),
            port_base=settings.fleet_port_base,
            gpu_nodes=settings.fleet_gpu_nodes,
            driver_mode=settings.fleet_driver_mode,
            operator_release=settings.operator_release,
            kubelet_nodes=settings.fleet_kubelet_nodes,
            gpu_rdma=settings.fleet_gpu_rdma,
            dra=settings.fleet_dra,
        )
        # default on wherever it can be: NVIDIADriver mode (a pool node gets an NVIDIADriver of its own)
        pool = settings.fleet_kubelet_pool
        layout = replace(
            layout,
            kubelet_pool=pool
            if pool is not None
            else (
                layout.driver_mode == "nvidiadriver"
                and layout.kubelet_nodes > 0
                and layout.operator_release in KUBELET_POOL_RELEASES
            ),
        )
        default = settings.fleet_default_nvidiadriver
        layout = replace(
            layout,
            default_driver=layout.driver_mode == "nvidiadriver"
            and (default if default is not None else layout.operator_release in DEFAULT_NVIDIADRIVER_RELEASES),
        )
        if layout.default_driver and layout.operator_release not in DEFAULT_NVIDIADRIVER_RELEASES:
            raise ConfigError(
                f"GPU Operator {layout.operator_release} has no default NVIDIADriver",
                hint="use " + " or ".join(DEFAULT_NVIDIADRIVER_RELEASES) + ", or "
                "GPUCANARY_FLEET_DEFAULT_NVIDIADRIVER=0",
            )
        if layout.dra:
            _check_gpu_cluster(layout)
        if layout.kubelet_pool and layout.operator_release not in KUBELET_POOL_RELEASES:
            raise ConfigError(
                f"a kubelet pool needs the driver's hostNetwork setting, which GPU Operator "
                f"{layout.operator_release} does not have",
                hint="use " + " or ".join(KUBELET_POOL_RELEASES) + ", or GPUCANARY_FLEET_KUBELET_POOL=0",
            )
        return layout.with_gpu_nodes(layout.gpu_nodes)

    def with_gpu_nodes(self, count: int) -> FleetLayout:
        if not 1 <= count <= MAX_GPU_NODES:
            raise ConfigError(f"GPU node count {count} is out of range", hint=f"use 1 to {MAX_GPU_NODES}")
        return replace(self, gpu_nodes=count)

    def port(self, component: str) -> int:
        return self.port_base + PORT_OFFSETS[component]

    def kubelet_node_port(self, index: int, name: str) -> int:
        """A port of real kubelet node `index`: one of KUBELET_NODE_PORTS."""
        return self.port_base + KUBELET_NODE_OFFSET + index * len(KUBELET_NODE_PORTS) + KUBELET_NODE_PORTS.index(name)

    def kubelet_service_port(self, index: int) -> int:
        """Where the canary's default service listens on kubelet pool node `index` (127.0.0.1, hostNetwork)."""
        return self.port_base + KUBELET_SERVICE_OFFSET + index

    @property
    def kubelet_workload_ports(self) -> tuple[int, ...]:
        """Ports that hostNetwork pods on the kubelet nodes may bind on 127.0.0.1."""
        return tuple(self.port_base + offset for offset in KUBELET_WORKLOAD_OFFSETS)

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def audit_policy(self) -> Path:
        return self.root / "audit-policy.yaml"

    @property
    def audit_log(self) -> Path:
        """The apiserver's audit log; rotated files sit next to it as audit-<time>.log."""
        return self.logs / "audit.log"

    @property
    def state_file(self) -> Path:
        return self.root / "fleet.json"

    @property
    def apiserver_url(self) -> str:
        return f"https://{HOST}:{self.port('kube-apiserver')}"

    @property
    def prometheus_url(self) -> str:
        return f"http://{HOST}:{self.port('prometheus')}"


def _check_gpu_cluster(layout: FleetLayout) -> None:
    """GPUCluster mode needs a release that has it and NVIDIADriver mode (the operator reconciles no NVIDIADriver
    beside a ClusterPolicy that keeps the driver); its kubelet nodes are canary pools, where the operator runs NVIDIA's
    DRA kubelet plugin (a node with the device plugin as a fleet process has no place in it)."""
    if layout.operator_release not in GPU_CLUSTER_RELEASES:
        raise ConfigError(
            f"GPU Operator {layout.operator_release} has no GPUCluster (GPUCANARY_FLEET_DRA=1)",
            hint="use " + " or ".join(GPU_CLUSTER_RELEASES),
        )
    if layout.driver_mode != "nvidiadriver":
        raise ConfigError(
            "GPUCluster mode (GPUCANARY_FLEET_DRA=1) takes its drivers from NVIDIADriver CRs",
            hint="use GPUCANARY_FLEET_DRIVER_MODE=nvidiadriver",
        )
    if layout.kubelet_nodes and not layout.kubelet_pool:
        raise ConfigError(
            "in GPUCluster mode (GPUCANARY_FLEET_DRA=1) the kubelet nodes are canary pools, where the operator runs "
            "NVIDIA's DRA kubelet plugin",
            hint="unset GPUCANARY_FLEET_KUBELET_POOL, or set GPUCANARY_FLEET_KUBELET_NODES=0",
        )
