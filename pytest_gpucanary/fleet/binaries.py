"""Find the fleet's binaries: an explicit directory from the environment, else the repo's cached Go
builds (built on first use by ci/build.sh and ci/build-operator.sh <release>)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.config import flag
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet.layout import FleetSettings


@dataclass(frozen=True)
class Binaries:
    """The directories a fleet's processes run from."""

    control_plane: Path
    operator: Path
    kubelet_node: Path | None = None  # None: the fleet has no real kubelet nodes
    nfd_master: Path | None = None  # None: no kubelet pool, so no GFD for nfd-master to serve


CI_DIR = Path(__file__).resolve().parents[2] / "ci"


@dataclass(frozen=True)
class Build:
    setting: str  # the FleetSettings field naming a prebuilt directory instead
    script: str
    required: tuple[str, ...]
    cached_as: str  # how the script names its output under <cache>/bin/ (then the release, if any, then a digest)

    @property
    def env_var(self) -> str:
        return "GPUCANARY_" + self.setting.upper()


CONTROL_PLANE = Build(
    "bin_dir",
    "build.sh",
    ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok"),
    "k8s-",
)
GPU_OPERATOR = Build("operator_bin_dir", "build-operator.sh", ("gpu-operator", "paths.env"), "gpu-operator-")
# the kubelet node's libnvidia-ml stand-in, and the client that asks it through NVIDIA's Go bindings
NVML_SHIM = Build("nvml_shim_dir", "build-nvml-shim.sh", ("libnvidia-ml.so.1", "nvml-check"), "nvml-shim-")
# NVIDIA's k8s-device-plugin and GFD, unmodified, which a kubelet pool node runs over that stand-in
# NFD's nfd-master, which labels a kubelet pool node from GFD's NodeFeature
NFD_MASTER = Build("nfd_master_dir", "build-nfd-master.sh", ("nfd-master", "nfd-api-crds.yaml"), "nfd-master-")
DEVICE_PLUGIN = Build(
    "device_plugin_dir",
    "build-device-plugin.sh",
    ("nvidia-device-plugin", "gpu-feature-discovery"),
    "k8s-device-plugin-",
)
# NVIDIA's DRA kubelet plugin, unmodified, with the nvidia-cdi-hook its image carries: a kubelet pool node's GPUs in
# GPUCluster mode
DRA_DRIVER = Build(
    "dra_driver_dir", "build-dra-driver.sh", ("gpu-kubelet-plugin", "nvidia-cdi-hook"), "dra-driver-nvidia-gpu-"
)
# containerd 2, which applies the CDI devices the kubelet passes for a prepared claim: a kubelet node's runtime in
# GPUCluster mode (Debian's containerd 1.6 elsewhere)
CONTAINERD = Build(
    "containerd_dir", "build-containerd.sh", ("containerd", "containerd-shim-runc-v2", "ctr"), "containerd-"
)


def find_bin_dir(build: Build, progress: Callable[[str], None], *args: str) -> Path:
    """`args` go to the build script (the operator's: the release to build). Without the checkout's scripts (an
    installed package), the newest complete build the scripts left in the cache."""
    settings = FleetSettings.from_env()
    explicit = getattr(settings, build.setting)
    script = CI_DIR / build.script
    if explicit:
        bin_dir = Path(explicit)
    elif script.exists():
        bin_dir = _build(script, progress, args)
    elif cached := newest_cached(build, settings.cache, *args):
        bin_dir = cached
        progress(f"fleet: {build.required[0]} from the build cache: {bin_dir}")
    else:
        raise EnvError(
            f"no {build.required[0]} binaries found",
            hint=f"set {build.env_var} to a directory with " + ", ".join(build.required),
        )
    missing = [name for name in build.required if not (bin_dir / name).exists()]
    if missing:
        raise EnvError(
            f"missing binary {bin_dir / missing[0]}", hint=f"run {script} or point {build.env_var} at a complete build"
        )
    return bin_dir


def newest_cached(build: Build, cache: Path | None, *args: str) -> Path | None:
    """The most recent directory the build script completed under <cache>/bin (a half-written one ends in
    `.partial` and lacks files), for `args` (the operator's release) when given."""
    root = (cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpucanary") / "bin"
    prefix = build.cached_as + "".join(f"{arg}-" for arg in args)
    done = [
        d
        for d in root.glob(prefix + "*")
        if d.is_dir() and not d.name.endswith(".partial") and all((d / name).exists() for name in build.required)
    ]
    return max(done, key=lambda d: d.stat().st_mtime, default=None)


def find_operator_bin_dir(release: str, progress: Callable[[str], None]) -> Path:
    """The operator build for `release`; an explicit GPUCANARY_OPERATOR_BIN_DIR must hold that release."""
    bin_dir = find_bin_dir(GPU_OPERATOR, progress, release)
    built = operator_release(bin_dir)
    if built != release:
        raise EnvError(
            f"the GPU Operator in {bin_dir} is {built}, not {release}",
            hint=f"set GPUCANARY_OPERATOR_RELEASE={built} or point {GPU_OPERATOR.env_var} at a "
            f"{release} build (bash ci/build-operator.sh {release})",
        )
    return bin_dir


def operator_chart(release: str, progress: Callable[[str], None]) -> Path:
    """The gpu-operator Helm chart of `release`, from the same tree the operator binary was built from."""
    bin_dir = find_operator_bin_dir(release, progress)
    chart = Path(read_paths_env(bin_dir).get("GPU_OPERATOR_MODULE_DIR", "")) / "deployments" / "gpu-operator"
    if not (chart / "Chart.yaml").is_file():
        raise EnvError(
            f"the GPU Operator {release} tree of {bin_dir} has no chart at {chart}",
            hint=f"rebuild it (bash ci/build-operator.sh {release}) or pass {flag('helm_chart')}=PATH",
        )
    return chart


def operator_release(bin_dir: Path) -> str:
    return read_paths_env(bin_dir).get("GPU_OPERATOR_VERSION", "unknown")


def read_paths_env(bin_dir: Path) -> dict[str, str]:
    """KEY=VALUE lines that ci/build-operator.sh writes beside the operator binary."""
    pairs = (line.split("=", 1) for line in (bin_dir / "paths.env").read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs}


def _build(script: Path, progress: Callable[[str], None], args: tuple[str, ...]) -> Path:
    if shutil.which("go") is None:
        raise EnvError(
            "Go is not installed, so the fleet cannot be built",
            hint="install Go >= 1.26 or set GPUCANARY_BIN_DIR and GPUCANARY_OPERATOR_BIN_DIR",
        )
    progress(f"fleet: ensuring binaries ({' '.join((script.name, *args))}; a cold build takes minutes)")
    proc = subprocess.Popen(["bash", str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and proc.stdout is not None
    tail: list[str] = []
    for line in proc.stderr:
        tail = (tail + [line.rstrip()])[-5:]
        if not line.startswith("go: downloading"):
            progress(f"fleet: {line.rstrip()}")
    out = proc.stdout.read().strip()
    if proc.wait() != 0 or not out:
        raise EnvError(
            f"{script.name} failed: {tail[-1] if tail else 'no output'}",
            hint=f"run bash {' '.join((str(script), *args))} to see the whole log",
        )
    return Path(out.splitlines()[-1])
