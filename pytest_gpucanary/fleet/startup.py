"""How the local fleet comes up: the host checks, the fleet directory's files and state, each component
started in order and healthy, the fleet's nodes created and Ready, the GPU Operator's CRDs and policies, and
the waits until a canary can run at once. `Fleet.up` runs these steps; everything else about a running
fleet stays in fleet.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import yaml

from pytest_gpucanary.canary import metrics
from pytest_gpucanary.canary.publish import NAMESPACE as VERDICT_NAMESPACE
from pytest_gpucanary.canary.workloads import PRIORITY_CLASS_MANIFEST
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet import components, kubelet_nodes, manifests, operator, processes, waits
from pytest_gpucanary.fleet.binaries import Binaries, operator_release, read_paths_env
from pytest_gpucanary.fleet.kubelet_nodes import KubeletNodes
from pytest_gpucanary.fleet.pki import ensure_pki, write_kubeconfig
from pytest_gpucanary.kube import Kube

if TYPE_CHECKING:
    from pytest_gpucanary.fleet.components import Component
    from pytest_gpucanary.fleet.layout import FleetLayout

Progress = Callable[[str], None]

USER_AGENT = "gpucanary-fleet"  # not gpucanary/<version>: the audit log tells the canary apart by it
FLEET_NODE_SELECTOR = "gpucanary.io/fleet=local"  # the fleet's own node templates carry it
APPLY_CHUNK = 50
APPLY_PARALLELISM = 4
START_TIMEOUT_S = {"etcd": 30, "kube-apiserver": 120, "prometheus": 60}
SERIES_TIMEOUT_S = 120.0
NODES_READY_TIMEOUT_S = 120
HOST_ETC_MOUNTPOINT = Path("/host-etc")


class Fleet(Protocol):
    """The fleet as its start-up reads it (`fleet.Fleet`)."""

    @property
    def layout(self) -> FleetLayout: ...

    @property
    def kubeconfig(self) -> Path: ...

    @property
    def prometheus_url(self) -> str: ...

    def binaries(self) -> Binaries | None: ...

    def operator_release(self) -> str | None: ...

    def gpu_node_names(self) -> list[str]: ...

    def components(self, binaries: Binaries) -> list[Component]: ...

    def all_components(self, binaries: Binaries) -> list[Component]: ...

    def nfd_master(self, binaries: Binaries) -> list[Component]: ...

    def kubectl(
        self, *args: str, stdin: str | None = None, timeout_s: float = 60, bin_dir: Path | None = None
    ) -> str: ...


def _node_ready(node: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in node.get("status", {}).get("conditions") or []
    )


def refuse_other_release(fleet: Fleet) -> None:
    running, wanted = fleet.operator_release(), fleet.layout.operator_release
    if running != wanted:
        raise EnvError(
            f"the fleet in {fleet.layout.root} runs GPU Operator {running}, not {wanted}",
            hint=f"run `gpucanary fleet down` first, or set GPUCANARY_OPERATOR_RELEASE={running}",
        )


def start_ingress_only(fleet: Fleet, progress: Progress) -> bool:
    """A fleet started before the ingress existed gets just the ingress, not a refusal to start."""
    binaries = fleet.binaries()
    if binaries is None:
        return False
    *others, ingress = fleet.components(binaries)
    if processes.pid_of(fleet.layout, ingress.name) or not all(
        processes.pid_of(fleet.layout, c.name) and processes.healthy(fleet.layout, c) for c in others
    ):
        return False
    start(fleet, ingress, progress)
    return True


def check_host(fleet: Fleet, binaries: Binaries) -> None:
    if shutil.which("prometheus") is None:
        raise EnvError("prometheus is not installed", hint="apt-get install prometheus")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise EnvError(
            "the GPU Operator needs /opt/gpu-operator and /host-etc, which the fleet mounts in a "
            "private mount namespace",
            hint="run the fleet as root with util-linux's unshare",
        )
    if binaries.kubelet_node is not None:
        kubelet_nodes.check_host()
    for part in fleet.all_components(binaries):
        if part.port and processes.port_in_use(part.port):
            raise EnvError(
                f"port 127.0.0.1:{part.port} for {part.name} is already in use",
                hint="stop what listens there or set GPUCANARY_FLEET_PORT_BASE to another base",
            )


def start_all(fleet: Fleet, binaries: Binaries, progress: Progress) -> None:
    *others, operator_part, agent, ingress = fleet.components(binaries)
    for part in others:
        start(fleet, part, progress)
    ensure_nodes(fleet, progress, binaries.control_plane)
    if binaries.kubelet_node is not None:
        KubeletNodes.planned(fleet.layout, binaries.kubelet_node).start(
            _kubectl_for(fleet, binaries.control_plane), progress, operator_bin_dir=binaries.operator
        )
    paths = read_paths_env(binaries.operator)
    progress(f"fleet: installing the GPU Operator {paths['GPU_OPERATOR_VERSION']} CRDs")
    operator.install_crds(_kubectl_for(fleet, binaries.control_plane), Path(paths["GPU_OPERATOR_CRD_DIR"]))
    for part in fleet.nfd_master(binaries):  # GFD on a kubelet pool node writes NodeFeatures for it
        progress("fleet: installing NFD's CRDs")
        assert binaries.nfd_master is not None  # nfd_master gives a part only then
        _kubectl_for(fleet, binaries.control_plane)(
            "apply",
            "--server-side",
            "--field-manager=gpucanary-fleet",
            "-f",
            str(binaries.nfd_master / "nfd-api-crds.yaml"),
        )
        start(fleet, part, progress)
    start(fleet, operator_part, progress)
    start(fleet, agent, progress)
    start(fleet, ingress, progress)
    ensure_canary_prerequisites(_kubectl_for(fleet, binaries.control_plane))
    operator.apply_policies(
        _kubectl_for(fleet, binaries.control_plane),
        driver_mode=fleet.layout.driver_mode,
        release=paths["GPU_OPERATOR_VERSION"],
        rdma=fleet.layout.gpu_rdma,
        pool_nodes=_kubelet_pool_nodes(fleet, binaries),
        apiserver_url=fleet.layout.apiserver_url,
        default_driver=fleet.layout.default_driver,
        gpu_cluster=fleet.layout.dra,
    )
    plugin = "DRA kubelet plugin" if fleet.layout.dra else "device-plugin"
    progress(f"fleet: waiting for the driver, {plugin} and validator pods on every GPU node")
    # in GPUCluster mode a kubelet pool node's GPUs are its DRA kubelet plugin's slices, as on a KWOK node
    gpu_nodes = fleet.gpu_node_names() + (list(_kubelet_pool_nodes(fleet, binaries)) if fleet.layout.dra else [])
    operator.wait_ready(_kube(fleet), gpu_nodes, progress, gpu_cluster=fleet.layout.dra)
    _wait_series(fleet, progress)
    if binaries.kubelet_node is not None:
        KubeletNodes.planned(fleet.layout, binaries.kubelet_node).wait_operator_gpus(
            _kubectl_for(fleet, binaries.control_plane), progress
        )


def _kubelet_pool_nodes(fleet: Fleet, binaries: Binaries) -> tuple[str, ...]:
    if binaries.kubelet_node is None or not fleet.layout.kubelet_pool:
        return ()
    return tuple(node.name for node in KubeletNodes.planned(fleet.layout, binaries.kubelet_node).nodes())


def _wait_series(fleet: Fleet, progress: Progress) -> None:
    """Until Prometheus holds every series a canary's preflight asks for, so a run can follow `fleet up`
    at once (its scrapes and service discovery run every 5 s)."""
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while missing := metrics.missing_series(fleet.prometheus_url):
        if time.monotonic() > deadline:
            raise EnvError(
                f"the fleet's Prometheus still lacks a series after {SERIES_TIMEOUT_S:.0f} s: {missing[0]}",
                hint=f"see {fleet.layout.logs / 'prometheus.log'}",
            )
        time.sleep(1.0)


def start(fleet: Fleet, part: components.Component, progress: Progress) -> None:
    progress(f"fleet: starting {part.name} {processes.where(part)}")
    proc = processes.start(fleet.layout, part)
    processes.wait_healthy(fleet.layout, part, proc, timeout_s=START_TIMEOUT_S.get(part.name, 60))


def refuse_leftovers(fleet: Fleet) -> None:
    leftovers = processes.owned_pids(fleet.layout)
    if leftovers:
        raise EnvError(
            f"a previous fleet in {fleet.layout.root} is half-started ({len(leftovers)} processes "
            "still running, not all healthy)",
            hint="run `gpucanary fleet down` first",
        )


def prepare(fleet: Fleet, binaries: Binaries) -> None:
    layout = fleet.layout
    layout.root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(layout.data, ignore_errors=True)
    layout.data.mkdir(parents=True)
    ensure_pki(layout.pki)
    if binaries.kubelet_node is not None:
        kubelet_nodes.write_hosts(layout)
    write_kubeconfig(layout.kubeconfig, server=layout.apiserver_url, pki=layout.pki)
    (layout.root / "kwok.yaml").write_text(manifests.kwok_config(binaries.control_plane, gpu_nodes=layout.gpu_nodes))
    (layout.root / "prometheus.yml").write_text(manifests.prometheus_config(layout))
    layout.audit_policy.write_text(manifests.audit_policy())
    _prepare_operator_files(fleet, read_paths_env(binaries.operator))
    save_state(fleet, binaries, startup_s=None)


def _prepare_operator_files(fleet: Fleet, paths: dict[str, str]) -> None:
    """Unedited copies of the operator's manifests and a host os-release, as its image would have."""
    opt = fleet.layout.root / "opt" / "gpu-operator"
    shutil.rmtree(opt.parent, ignore_errors=True)
    shutil.copytree(paths["GPU_OPERATOR_ASSETS_DIR"], opt)
    shutil.copytree(paths["GPU_OPERATOR_MANIFESTS_DIR"], opt / "manifests")
    host_etc = fleet.layout.root / "host-etc"
    host_etc.mkdir(exist_ok=True)
    shutil.copy(manifests.FLEET_FIXTURES / "host-etc" / "os-release", host_etc / "os-release")
    HOST_ETC_MOUNTPOINT.mkdir(exist_ok=True)  # an empty mount point; the fleet's copy is mounted on it


def save_state(fleet: Fleet, binaries: Binaries, *, startup_s: float | None) -> None:
    state = {
        "bin_dir": str(binaries.control_plane),
        "operator_bin_dir": str(binaries.operator),
        "operator_release": operator_release(binaries.operator),
        "driver_mode": fleet.layout.driver_mode,
        "gpu_nodes": fleet.layout.gpu_nodes,
        "startup_s": startup_s,
        "kubeconfig": str(fleet.kubeconfig),
        "prometheus_url": fleet.prometheus_url,
        "kubelet_pool": bool(_kubelet_pool_nodes(fleet, binaries)),
        "kubelet_node_bin_dir": str(binaries.kubelet_node) if binaries.kubelet_node else None,
        "nfd_master_bin_dir": str(binaries.nfd_master) if binaries.nfd_master else None,
    }
    fleet.layout.state_file.write_text(json.dumps(state, indent=2) + "\n")


def ensure_canary_prerequisites(kubectl: Callable[..., str]) -> None:
    """The PriorityClass every canary pod names and the namespace that keeps verdicts
    (deploy/priorityclass.yaml and deploy/rbac.yaml on a real cluster)."""
    verdicts = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": VERDICT_NAMESPACE}}
    kubectl(
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [PRIORITY_CLASS_MANIFEST, verdicts]}),
    )


def _kubectl_for(fleet: Fleet, bin_dir: Path) -> Callable[..., str]:
    return lambda *args, **kwargs: fleet.kubectl(*args, bin_dir=bin_dir, **kwargs)


def _kube(fleet: Fleet) -> Kube:
    return Kube.connect(fleet.kubeconfig, user_agent=USER_AGENT)


def ensure_nodes(fleet: Fleet, progress: Progress, bin_dir: Path | None = None) -> None:
    """Create the fleet's nodes that do not exist yet and wait until every one is Ready.

    Server-side apply in chunks, a few kubectl processes at a time: one kubectl applies its
    objects one request after another, which takes minutes for 1,000 nodes on 2 cores.
    """
    nodes = manifests.fleet_nodes(fleet.layout)
    kube = _kube(fleet)
    existing = {n["metadata"]["name"] for n in kube.list("v1", "Node", label_selector=FLEET_NODE_SELECTOR)}
    missing = [n for n in nodes if n["metadata"]["name"] not in existing]
    progress(f"fleet: ensuring {fleet.layout.gpu_nodes} GPU nodes and 1 CPU node ({len(missing)} to create)")
    chunks = [missing[i : i + APPLY_CHUNK] for i in range(0, len(missing), APPLY_CHUNK)]
    with ThreadPoolExecutor(max_workers=APPLY_PARALLELISM) as pool:
        list(
            pool.map(
                lambda chunk: fleet.kubectl(
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "--field-manager=gpucanary-fleet",
                    "-f",
                    "-",
                    stdin=yaml.safe_dump_all(chunk),
                    timeout_s=120,
                    bin_dir=bin_dir,
                ),
                chunks,
            )
        )
    names = {n["metadata"]["name"] for n in nodes}
    timeout_s = NODES_READY_TIMEOUT_S + 0.1 * len(names)
    try:
        waits.wait_all(
            kube,
            "v1",
            "Node",
            label_selector=FLEET_NODE_SELECTOR,
            wanted=set(names),
            satisfies=lambda node: [node["metadata"]["name"]] if _node_ready(node) else [],
            timeout_s=timeout_s,
            progress=progress,
            what="Ready nodes",
        )
    except TimeoutError as exc:
        raise EnvError(str(exc)[:300], hint=f"see {fleet.layout.logs / 'kwok.log'}") from None
    _wait_default_service_account(fleet, bin_dir)


def _wait_default_service_account(fleet: Fleet, bin_dir: Path | None) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            fleet.kubectl("get", "serviceaccount", "default", "-n", "default", bin_dir=bin_dir)
            return
        except EnvError:
            if time.monotonic() > deadline:
                raise EnvError(
                    "the default ServiceAccount never appeared",
                    hint=f"see {fleet.layout.logs / 'kube-controller-manager.log'}",
                ) from None
            time.sleep(0.5)
