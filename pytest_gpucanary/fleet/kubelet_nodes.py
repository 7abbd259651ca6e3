"""Start and stop the fleet's real kubelet nodes (GPUCANARY_FLEET_KUBELET_NODES, default 1).

A node counts as started when it is Ready with `nvidia.com/gpu: 8` allocatable from the device
plugin and carries the KWOK GPU nodes' NFD/GFD labels. Stopping leaves nothing of it on the machine:
no process (pods' included), no mount, no cgroup, no directory. Cleanup finds a node by its
directory and cgroup root names, so it also works after a crashed start. Never touches KWOK nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.config import GPU_JOB_IMAGE, PROBE_IMAGE, SERVICE_IMAGE
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet import images, node_cgroups, processes
from pytest_gpucanary.fleet.binaries import CONTAINERD, DEVICE_PLUGIN, DRA_DRIVER, NVML_SHIM, Build, find_bin_dir
from pytest_gpucanary.fleet.components import VALIDATOR_IMAGE, Component
from pytest_gpucanary.fleet.kubelet_node import (
    DEBIAN_LOOPBACK_PLUGIN,
    DRIVER_FAULTS,
    GPUS_PER_NODE,
    KubeletNode,
    dra_plugin_image_name,
    driver_images,
    gpu_labels,
    hosts_text,
    operator_images,
)
from pytest_gpucanary.fleet.layout import FleetLayout

Progress = Callable[[str], None]
Kubectl = Callable[..., str]
KUBELET_NODE_BUILD = Build(
    "kubelet_bin_dir",
    "build-kubelet.sh",
    ("kubelet", "pause", "gpucanary-netns", "allreduce", "driver-manager", "nvidia-container-runtime"),
    "kubelet-node-",
)
DEBIAN_TOOLS = {
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "nsenter": "util-linux",
    "ip": "iproute2",
    "openssl": "openssl",
}
READY_TIMEOUT_S = 120
_APISERVER_HOSTS = 'mount --bind "$0" /etc/hosts && exec "$@"'


def find_kubelet_bin_dir(progress: Progress) -> Path:
    return find_bin_dir(KUBELET_NODE_BUILD, progress)


def check_host() -> None:
    missing = sorted({package for tool, package in DEBIAN_TOOLS.items() if shutil.which(tool) is None})
    if not DEBIAN_LOOPBACK_PLUGIN.exists():
        missing.append("containernetworking-plugins")
    if missing:
        raise EnvError(
            f"the kubelet node needs Debian packages {', '.join(missing)}",
            hint="run ci/install-node-deps.sh, or set GPUCANARY_FLEET_KUBELET_NODES=0",
        )


def hosts_file(layout: FleetLayout) -> Path:
    return layout.root / "hosts"


def write_hosts(layout: FleetLayout) -> None:
    hosts_file(layout).write_text(hosts_text(layout))


def with_node_hosts(layout: FleetLayout, apiserver: Component) -> Component:
    """The apiserver in a private mount namespace whose /etc/hosts names the kubelet nodes."""
    argv = (
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        _APISERVER_HOSTS,
        str(hosts_file(layout)),
        *apiserver.argv,
    )
    return Component(apiserver.name, argv, apiserver.health_url, apiserver.port, apiserver.env)


def _state_file(layout: FleetLayout) -> Path:
    return layout.data / "nodes" / "nodes.json"


@dataclass(frozen=True)
class KubeletNodes:
    layout: FleetLayout
    bin_dir: Path
    count: int

    @classmethod
    def planned(cls, layout: FleetLayout, bin_dir: Path) -> KubeletNodes:
        return cls(layout, bin_dir, layout.kubelet_nodes)

    @classmethod
    def running(cls, layout: FleetLayout) -> KubeletNodes | None:
        """The nodes the running (or last started) fleet has, from their state file."""
        try:
            state = json.loads(_state_file(layout).read_text())
            return cls(layout, Path(state["bin_dir"]), int(state["count"]))
        except (OSError, ValueError, KeyError):
            return None

    def nodes(self, runtime_dir: Path | None = None) -> list[KubeletNode]:
        return [KubeletNode(self.layout, i, self.bin_dir, runtime_dir) for i in range(self.count)]

    def components(self) -> list[Component]:
        return [part for node in self.nodes() for part in node.components()]

    def start(self, kubectl: Kubectl, progress: Progress, *, operator_bin_dir: Path) -> dict[str, float]:
        """Start every node; returns seconds from containerd start to Ready with GPUs, per node. A canary
        pool's validator is the one built beside the operator in `operator_bin_dir`."""
        check_host()
        hosts = hosts_text(self.layout)
        specs = images.node_images(self.bin_dir)
        plugin_dir = find_bin_dir(DEVICE_PLUGIN, progress)
        nvml_shim = find_bin_dir(NVML_SHIM, progress) / "libnvidia-ml.so.1"
        # GPUCluster mode: NVIDIA's DRA kubelet plugin, whose claims reach containers as CDI devices, which
        # containerd 2 applies (layout.check: every kubelet node is then a pool)
        runtime_dir = find_bin_dir(CONTAINERD, progress) if self.layout.dra else None
        if self.layout.kubelet_pool:
            names = operator_images()
            validator = operator_bin_dir / "nvidia-validator"
            if not validator.is_file():
                raise EnvError(
                    f"the GPU Operator build in {operator_bin_dir} has no nvidia-validator, which a kubelet pool runs",
                    hint="rebuild it: bash ci/build-operator.sh <release>",
                )
            if self.layout.dra:
                specs.append(images.dra_plugin_image(dra_plugin_image_name(), find_bin_dir(DRA_DRIVER, progress)))
            else:
                specs += images.operator_plugin_images(device_plugin=names["devicePlugin"], plugin_dir=plugin_dir)
            specs += images.pool_operand_images(
                self.bin_dir,
                self.layout.apiserver_url,
                # in GPUCluster mode the operator names NVIDIA's validator by its VALIDATOR_IMAGE
                validator=(names["validator"], f"{VALIDATOR_IMAGE}:{self.layout.operator_release}"),
                validator_bin=validator,
                nvml_shim=nvml_shim,
                driver_manager=names["driverManager"],
                drivers=driver_images(),
                cuda_sample=GPU_JOB_IMAGE,
                probe=PROBE_IMAGE,
                service=SERVICE_IMAGE,
                faults=DRIVER_FAULTS,
            )
        _state_file(self.layout).parent.mkdir(parents=True, exist_ok=True)
        _state_file(self.layout).write_text(json.dumps({"bin_dir": str(self.bin_dir), "count": self.count}))
        started = {
            node.name: self._start_node(
                node,
                specs,
                hosts,
                kubectl,
                progress,
                device_plugin=plugin_dir / "nvidia-device-plugin",
                nvml_shim=nvml_shim,
            )
            for node in self.nodes(runtime_dir)
        }
        state = {"bin_dir": str(self.bin_dir), "count": self.count, "start_s": started}
        _state_file(self.layout).write_text(json.dumps(state, indent=2) + "\n")
        return started

    def _start_node(
        self,
        node: KubeletNode,
        specs: list[images.ImageSpec],
        hosts: str,
        kubectl: Kubectl,
        progress: Progress,
        *,
        device_plugin: Path,
        nvml_shim: Path,
    ) -> float:
        begin = time.monotonic()
        node.prepare(hosts, device_plugin=device_plugin, nvml_shim=nvml_shim)
        node_cgroups.create(node.cgroup_root)
        containerd, kubelet, *plugin = node.components()
        _start(self.layout, containerd, progress)
        pid = processes.pid_of(self.layout, containerd.name)
        node.namespace_file.write_text(os.readlink(f"/proc/{pid}/ns/mnt"))
        images.import_images(
            specs,
            directory=node.dir / "images",
            address=node.containerd_socket,
            enter=("nsenter", f"--mount=/proc/{pid}/ns/mnt", "--"),
            ctr=node.runtime_dir / "ctr" if node.runtime_dir else None,
        )
        _start(self.layout, kubelet, progress)
        for part in plugin:
            _start(self.layout, part, progress)
        _wait_registered(kubectl, node.name)
        kubectl(
            "label", "node", node.name, "--overwrite", *(f"{k}={v}" for k, v in gpu_labels(gfd=not node.pool).items())
        )
        _wait(kubectl, node.name, "--for=condition=Ready")
        if plugin:
            _wait_gpus(kubectl, node.name)
        elapsed_s = time.monotonic() - begin
        gpus = f"with {GPUS_PER_NODE} GPUs " if plugin else "(GPUs come with the operator's device plugin) "
        progress(f"fleet: kubelet node {node.name} Ready {gpus}in {elapsed_s:.1f} s")
        return elapsed_s

    def wait_operator_gpus(self, kubectl: Kubectl, progress: Progress) -> None:
        """On pool nodes: wait until the operator's device-plugin pod has advertised the GPUs and GFD's labels,
        through nfd-master, name them. (In GPUCluster mode the operator's wait covers pool nodes: their slices.)"""
        if not self.layout.kubelet_pool or self.layout.dra:
            return
        for node in self.nodes():
            progress(f"fleet: waiting for the GPU Operator's device plugin and GFD on {node.name}")
            _wait_gpus(kubectl, node.name)
            _wait(
                kubectl, node.name, "--for=jsonpath={.metadata.labels.nvidia\\.com/gpu\\.count}=" + str(GPUS_PER_NODE)
            )


def _start(layout: FleetLayout, part: Component, progress: Progress) -> None:
    progress(f"fleet: starting {part.name} {processes.where(part)}")
    proc = processes.start(layout, part)
    processes.wait_healthy(layout, part, proc, timeout_s=60)


def _wait_registered(kubectl: Kubectl, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            kubectl("get", "node", name, "-o", "name")
            return
        except EnvError:
            if time.monotonic() > deadline:
                raise EnvError(
                    f"kubelet node {name} never registered", hint=f"see the fleet's logs/{name}-kubelet.log"
                ) from None
            time.sleep(0.5)


def _wait_gpus(kubectl: Kubectl, name: str) -> None:
    _wait(kubectl, name, "--for=jsonpath={.status.allocatable.nvidia\\.com/gpu}=" + str(GPUS_PER_NODE))


def _wait(kubectl: Kubectl, name: str, condition: str) -> None:
    kubectl("wait", condition, f"--timeout={READY_TIMEOUT_S}s", f"node/{name}", timeout_s=READY_TIMEOUT_S + 10)


def _stop_pid(pid: int | None, *, grace_s: float = 10.0) -> None:
    if pid is None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            time.sleep(0.05)
        if not Path(f"/proc/{pid}").exists() or _state(pid) == "Z":
            return


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return ""


def namespace_members(namespace: str) -> list[int]:
    """Every process in the mount namespace `namespace` (as /proc/<pid>/ns/mnt reads)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "mnt") == namespace:
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _namespace_of(node_dir: Path) -> str | None:
    try:
        namespace = (node_dir / "mnt-namespace").read_text().strip()
    except OSError:
        return None
    # never the machine's own namespace, whatever the file says
    return namespace if namespace and namespace != os.readlink("/proc/self/ns/mnt") else None


def stop_nodes(layout: FleetLayout, progress: Progress = lambda line: None) -> None:
    """Stop every kubelet node of this fleet and remove what it left: processes, cgroups, files.

    Order: device plugin and kubelet first (so nothing restarts a container), then every process in
    the node's cgroups, then containerd, then whatever else is in its mount namespace (the shims).
    The namespace, with all its mounts, goes with the last of them."""
    root = layout.data / "nodes"
    names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    cgroup_prefix = f"gpucanary-{layout.port_base}-"
    cgroup_roots = {p.name for h in node_cgroups.hierarchies() for p in h.glob(cgroup_prefix + "*")}
    for name in names:
        for component in (f"{name}-device-plugin", f"{name}-kubelet"):
            _stop_pid(processes.pid_of(layout, component))
    for cgroup_root in cgroup_roots:
        node_cgroups.kill_all(cgroup_root)
    for name in names:
        namespace = _namespace_of(root / name)
        _stop_pid(processes.pid_of(layout, f"{name}-containerd"))
        for pid in namespace_members(namespace) if namespace else ():
            _stop_pid(pid, grace_s=2.0)
    left = [path for cgroup_root in cgroup_roots for path in node_cgroups.remove(cgroup_root)]
    for name in names:
        for component in (f"{name}-containerd", f"{name}-kubelet", f"{name}-device-plugin"):
            (layout.run / f"{component}.pid").unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    hosts_file(layout).unlink(missing_ok=True)
    if names:
        progress(f"fleet: stopped kubelet nodes {', '.join(names)}")
    if left:
        raise EnvError(
            f"cgroups of the kubelet node still hold processes: {left[0]}",
            hint="kill what is left in it, then run `gpucanary fleet down` again",
        )
