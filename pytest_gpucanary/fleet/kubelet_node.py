"""One real kubelet GPU node of the fleet: its files and its three processes.

kubelet v1.36 (built from the control plane's k8s.io/kubernetes module by ci/build-kubelet.sh),
containerd and runc from Debian, and, on a node that is no canary pool, NVIDIA's device plugin over the
NVML stand-in (a pool node gets it from the GPU Operator). Every port is on 127.0.0.1 in the fleet's
range; every file is under <fleet>/data/nodes/<name>.

The node is one private mount namespace, made by its containerd component and entered (nsenter) by
its kubelet and device plugin, so containerd, runc, the shims and the kubelet see the same node:
- /run is a fresh tmpfs (containerd's shim sockets, runc state, /run/netns);
- /var/lib is an overlay whose writes land in the node directory (the kubelet's hard-coded
  /var/lib/kubelet/device-plugins, libcni's cache), so nothing is created on the machine;
- /etc/hosts also names the fleet's kubelet nodes, and /etc/resolv.conf names only 127.0.0.1: no
  lookup (an image pull for a missing image, the kubelet resolving its own name) leaves the machine;
- four /proc/sys files are covered by files holding the values the kubelet wants, so it reads
  them back and never rewrites the machine's sysctls.
The namespace was made with private propagation, so its mounts are no peers of the machine's;
they are then made shared among themselves, which is what hostPath volumes with
mountPropagation (HostToContainer, Bidirectional) need. Each mount lives only in that namespace
and goes with its last process. Pods' cgroups live under
/<cgroup root> of their own (node_cgroups.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from pytest_gpucanary.canary.pool import DRIVER_POOL_LABEL
from pytest_gpucanary.fleet import node_config
from pytest_gpucanary.fleet.components import Component
from pytest_gpucanary.fleet.images import NVML_STATE_SCRIPT, nvml_gpus
from pytest_gpucanary.fleet.layout import HOST, FleetLayout
from pytest_gpucanary.fleet.manifests import FLEET_FIXTURES

GPUS_PER_NODE = 8
TAINT_KEY = "gpucanary.io/kubelet-node"  # keeps KWOK-era workloads off the real node until they opt in
NODE_KIND_LABEL = "gpucanary.io/node-kind"
# The kubelet's container manager sets these when they differ (setupKernelTunables); the node's
# namespace shows it these values, so the machine's stay as they are.
KERNEL_TUNABLES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}
NODE_LABELS = {NODE_KIND_LABEL: "kubelet", "gpucanary.io/fleet": "local"}
# With the device plugin as a fleet process, nvidia.com/gpu.deploy.operands=false keeps every GPU
# Operator operand off the node: their nvcr.io images are not on it (the KWOK GPU nodes run them).
PROCESS_PLUGIN_LABELS = {"nvidia.com/gpu.deploy.operands": "false"}
# A pool node deploys only the operands that run here; the operator keeps a deploy label that is already
# set, so "false" keeps each of the others off.
POOL_OPERANDS = ("driver", "operator-validator", "device-plugin", "gpu-feature-discovery")
POOL_LABELS = {
    f"nvidia.com/gpu.deploy.{operand}": "false"
    for operand in (
        "container-toolkit",
        "dcgm",
        "dcgm-exporter",
        "node-status-exporter",
        "mig-manager",
        "sandbox-validator",
        "sandbox-device-plugin",
        "vgpu-manager",
        "vgpu-device-manager",
        "vfio-manager",
        "kata-manager",
        "cc-manager",
    )
} | {f"nvidia.com/gpu.deploy.{operand}": "true" for operand in POOL_OPERANDS}
# The driver versions a pool node has images for, besides the fleet's own: a run to another version
# sees its driver pod fail to pull, and says so.
POOL_DRIVER_VERSIONS = ("580.95.05", "575.57.08", "570.172.08")
# Driver versions whose image is there but whose driver container fails, as field reports show it: "crash"
# prints the message and exits 1, as a driver that cannot build or load its kernel module does, so its pod
# crash-loops; "hang" prints the message and waits without loading (kernel headers from a package mirror
# an air-gapped node cannot reach), so its startup probe never passes and the operands wait behind it;
# "unvalidated" loads and turns Ready, but the validator's nvidia-smi fails with the message (a driver root
# whose libraries do not match the loaded module), so the operands wait behind a Ready driver.
DRIVER_FAULTS = {
    "574.0.1": (
        "crash",
        "ERROR: Unable to load the kernel module 'nvidia.ko': Unknown symbol in "
        "module (a GPL-only symbol on this kernel)",
    ),
    "574.0.2": ("hang", "Installing Linux kernel headers..."),
    "574.0.3": ("unvalidated", "Failed to initialize NVML: Driver/library version mismatch"),
}
_KWOK_ONLY_LABELS = ("type", "gpucanary.io/driver-pool", "nvidia.com/gpu.deploy.gpu-feature-discovery")
# containerd's CRI always adds the loopback network itself, from the same plugin directory
DEBIAN_LOOPBACK_PLUGIN = Path("/usr/lib/cni/loopback")

_NAMESPACE_SETUP = f"""set -e
mount -t tmpfs -o mode=0755,size=256m gpucanary-node-run /run
mount -t overlay gpucanary-node-varlib -o "lowerdir=/var/lib,upperdir=$0/varlib/upper,workdir=$0/varlib/work" /var/lib
mount --bind "$0/etc/hosts" /etc/hosts
mount --bind "$0/etc/resolv.conf" /etc/resolv.conf
for f in $(ls "$0/sysctl"); do mount --bind "$0/sysctl/$f" "/proc/sys/$(echo "$f" | tr : /)"; done
if [ -d "$0/dev" ]; then
  # an overlay on /dev takes what the operands' hostPath volumes create there (/dev/log, /dev/char)
  for m in shm pts; do mkdir -p "$0/dev/keep/$m" && mount --rbind "/dev/$m" "$0/dev/keep/$m"; done
  mount -t overlay gpucanary-node-dev -o "lowerdir=/dev,upperdir=$0/dev/upper,workdir=$0/dev/work" /dev
  for m in shm pts; do mount --move "$0/dev/keep/$m" "/dev/$m"; done
  # the GPUs' device nodes as the driver's module makes them (major 195): NVIDIA's device plugin hands them to
  # the containers it gives GPUs, whose runtime creates them there; nothing opens them
  for i in {" ".join(str(i) for i in range(GPUS_PER_NODE))}; do mknod -m 0666 "/dev/nvidia$i" c 195 "$i"; done
  mknod -m 0666 /dev/nvidiactl c 195 255
fi
mount --make-rshared /
exec "$@"
"""
_ENTER = 'exec nsenter --mount=/proc/$(cat "$0")/ns/mnt -- "$@"'


def node_name(index: int) -> str:
    return f"gpu-kubelet-{index}"


def hosts_text(layout: FleetLayout) -> str:
    """The machine's /etc/hosts plus every kubelet node name on 127.0.0.1.

    The apiserver reaches a kubelet by its Hostname address (`--kubelet-preferred-address-types`),
    and the kubelet looks its own name up; both read this file, so neither asks a DNS server."""
    names = " ".join(node_name(i) for i in range(layout.kubelet_nodes))
    return Path("/etc/hosts").read_text().rstrip("\n") + f"\n{HOST} {names}\n"


def gpu_labels(*, gfd: bool = True) -> dict[str, str]:
    """The NFD and GFD labels of the KWOK GPU nodes (fixtures/fleet/gpu-node.yaml), without theirs; without GFD's
    (`nvidia.com/`) where NVIDIA's GFD runs and writes its own."""
    labels = yaml.safe_load((FLEET_FIXTURES / "gpu-node.yaml").read_text())["metadata"]["labels"]
    return {
        k: v
        for k, v in labels.items()
        if k not in _KWOK_ONLY_LABELS
        and not k.startswith("kubernetes.io/")
        and (gfd or not k.startswith("nvidia.com/"))
    }


def operator_images() -> dict[str, str]:
    """Image names of the device plugin, the validator and the driver manager in the fleet's
    ClusterPolicy (the NVIDIADrivers give the same driver and manager images)."""
    spec = yaml.safe_load((FLEET_FIXTURES / "clusterpolicy.yaml").read_text())["spec"]
    names = {
        key: f"{spec[key]['repository']}/{spec[key]['image']}:{spec[key]['version']}"
        for key in ("devicePlugin", "validator")
    }
    manager = spec["driver"]["manager"]
    names["driverManager"] = f"{manager['repository']}/{manager['image']}:{manager['version']}"
    return names


def dra_plugin_image_name() -> str:
    """The image of the DRA kubelet plugin in the fleet's GPUCluster."""
    spec = yaml.safe_load((FLEET_FIXTURES / "gpucluster.yaml").read_text())["spec"]["draDriver"]
    return f"{spec['repository']}/{spec['image']}:{spec['version']}"


def fleet_driver_version() -> str:
    """The driver version of the fleet's ClusterPolicy and NVIDIADriver."""
    return str(yaml.safe_load((FLEET_FIXTURES / "clusterpolicy.yaml").read_text())["spec"]["driver"]["version"])


def driver_images() -> tuple[str, ...]:
    """The driver image names a pool node has: the fleet's version, POOL_DRIVER_VERSIONS and DRIVER_FAULTS,
    with the OS suffix the operator appends from the node's NFD labels."""
    spec = yaml.safe_load((FLEET_FIXTURES / "clusterpolicy.yaml").read_text())["spec"]["driver"]
    labels = gpu_labels()
    suffix = (
        labels["feature.node.kubernetes.io/system-os_release.ID"]
        + labels["feature.node.kubernetes.io/system-os_release.VERSION_ID"]
    )
    versions = dict.fromkeys((fleet_driver_version(), *POOL_DRIVER_VERSIONS, *DRIVER_FAULTS))
    return tuple(f"{spec['repository']}/{spec['image']}:{version}-{suffix}" for version in versions)


@dataclass(frozen=True)
class KubeletNode:
    layout: FleetLayout
    index: int
    bin_dir: Path
    runtime_dir: Path | None = None  # containerd 2 (ci/build-containerd.sh) in GPUCluster mode; else Debian's

    @property
    def name(self) -> str:
        return node_name(self.index)

    @property
    def dir(self) -> Path:
        return self.layout.data / "nodes" / self.name

    @property
    def cgroup_root(self) -> str:
        return f"gpucanary-{self.layout.port_base}-{self.name}"

    # Sockets live at the usual paths inside the node's namespace: a socket path under a deep
    # fleet directory would pass the kernel's 108-byte limit.
    containerd_socket = Path("/run/containerd/containerd.sock")
    kubelet_root = Path("/var/lib/kubelet")

    @property
    def namespace_file(self) -> Path:
        """Holds the node's mount namespace (as /proc/<pid>/ns/mnt reads), so cleanup finds its shims."""
        return self.dir / "mnt-namespace"

    def port(self, name: str) -> int:
        return self.layout.kubelet_node_port(self.index, name)

    @property
    def pool(self) -> bool:
        """A canary pool: the operator's driver, validator and device plugin run here (and nvidia.com/gpu
        comes from the operator's device-plugin pod, not a fleet process)."""
        return self.layout.kubelet_pool

    def labels(self) -> dict[str, str]:
        if self.pool:
            return NODE_LABELS | POOL_LABELS | {DRIVER_POOL_LABEL: self.name}
        return NODE_LABELS | PROCESS_PLUGIN_LABELS

    def taints(self) -> list[dict[str, str]]:
        """A pool is untainted, as a GPU node that shares its work with services: the canary's service
        tolerates no taint and is pinned there by hostname. Anything unpinned may land there too."""
        return [] if self.pool else [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]

    def component_names(self) -> tuple[str, str, str]:
        return f"{self.name}-containerd", f"{self.name}-kubelet", f"{self.name}-device-plugin"

    def components(self) -> list[Component]:
        """containerd (makes the namespace), kubelet and device plugin (enter it), in start order."""
        containerd, kubelet, plugin = self.component_names()
        pidfile = str(self.layout.run / f"{containerd}.pid")
        metrics, healthz = self.port("containerd-metrics"), self.port("kubelet-healthz")
        driver_root = str(self.dir / "driver-root")
        parts = [
            Component(
                containerd,
                (
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    _NAMESPACE_SETUP,
                    str(self.dir),
                    str(self.runtime_dir / "containerd")
                    if self.runtime_dir
                    else shutil.which("containerd") or "containerd",
                    f"--config={self.dir / 'containerd' / 'config.toml'}",
                ),
                f"http://{HOST}:{metrics}/v1/metrics",
                metrics,
                # containerd finds its runc shim on PATH
                env=(("PATH", f"{self.runtime_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"),)
                if self.runtime_dir
                else (),
            ),
            Component(
                kubelet,
                (
                    "sh",
                    "-c",
                    _ENTER,
                    pidfile,
                    str(self.bin_dir / "kubelet"),
                    f"--config={self.dir / 'kubelet' / 'config.yaml'}",
                    f"--kubeconfig={self.dir / 'kubeconfig'}",
                    f"--root-dir={self.kubelet_root}",
                    f"--cert-dir={self.dir / 'kubelet' / 'pki'}",
                    f"--hostname-override={self.name}",
                    "--v=2",
                    "--node-labels=" + ",".join(f"{k}={v}" for k, v in self.labels().items()),
                ),
                f"http://{HOST}:{healthz}/healthz",
                healthz,
            ),
            # NVIDIA's device plugin as a process of a node whose driver is installed on the host: it loads the
            # driver root's NVML (the stand-in, answering from the node's state file) and registers its GPUs
            Component(
                plugin,
                (
                    "sh",
                    "-c",
                    _ENTER,
                    pidfile,
                    str(self.dir / "device-plugin" / "nvidia-device-plugin"),
                    f"--driver-root={driver_root}",
                    f"--driver-root-ctr-path={driver_root}",
                ),
                "",
                0,
                env=(("GPUCANARY_NVML_STATE", str(self.dir / "nvml.env")), ("DP_DISABLE_HEALTHCHECKS", "all")),
            ),
        ]
        return parts[:2] if self.pool else parts

    def prepare(self, hosts: str, *, device_plugin: Path, nvml_shim: Path) -> None:
        """Every file the node's processes read; a leftover directory of a crashed node is replaced. A node that is
        no pool runs NVIDIA's `device_plugin` as a process over the `nvml_shim`, its driver installed on the host at
        the fleet's version."""
        shutil.rmtree(self.dir, ignore_errors=True)
        for sub in (
            "varlib/upper",
            "varlib/work",
            "etc",
            "sysctl",
            "cni/net.d",
            "cni/ipam",
            "cni/bin",
            "containerd",
            "kubelet/pki",
            "kubelet/pod-logs",
            "pki",
        ):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "etc" / "hosts").write_text(hosts)
        (self.dir / "etc" / "resolv.conf").write_text(f"nameserver {HOST}\n")
        for path, value in KERNEL_TUNABLES.items():
            (self.dir / "sysctl" / path.replace("/", ":")).write_text(value + "\n")
        if self.pool:
            for sub in ("dev/upper", "dev/work", "dev/keep"):
                (self.dir / sub).mkdir(parents=True)
        else:
            (self.dir / "device-plugin").mkdir()
            (self.dir / "device-plugin" / "nvidia-device-plugin").symlink_to(device_plugin)
            (self.dir / "driver-root" / "usr" / "lib64").mkdir(parents=True)
            shutil.copy(nvml_shim, self.dir / "driver-root" / "usr" / "lib64" / "libnvidia-ml.so.1")
            gpus = self.dir / "nvml-gpus"
            gpus.write_text(nvml_gpus(fleet_driver_version()))
            subprocess.run(
                ["sh", "-c", NVML_STATE_SCRIPT.decode(), "nvml-state", str(gpus), str(self.dir / "nvml.env")],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NODE_NAME": self.name},
                check=True,
            )
        (self.dir / "cni" / "bin" / "loopback").symlink_to(DEBIAN_LOOPBACK_PLUGIN)
        (self.dir / "cni" / "bin" / "gpucanary-netns").symlink_to(self.bin_dir / "gpucanary-netns")
        (self.dir / "cni" / "net.d" / "10-gpucanary-netns.conflist").write_text(
            json.dumps(node_config.cni_config(self))
        )
        (self.dir / "containerd" / "config.toml").write_text(node_config.containerd_config(self))
        (self.dir / "kubelet" / "config.yaml").write_text(
            yaml.safe_dump(node_config.kubelet_config(self), sort_keys=False)
        )
        node_config.credentials(self)
