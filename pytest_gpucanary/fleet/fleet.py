"""The local GPU fleet: a real control plane on 127.0.0.1 with KWOK GPU nodes, the real NVIDIA GPU
Operator controller and Prometheus.

Owns the processes it starts and the fleet directory; never touches any other cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pytest_gpucanary.canary import metrics
from pytest_gpucanary.canary.publish import NAMESPACE as VERDICT_NAMESPACE
from pytest_gpucanary.canary.workloads import PRIORITY_CLASS_MANIFEST
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet import components, kubelet_nodes, manifests, operator, processes, waits
from pytest_gpucanary.fleet.binaries import (
    CONTROL_PLANE,
    NFD_MASTER,
    find_bin_dir,
    find_operator_bin_dir,
    operator_chart,
    operator_release,
    read_paths_env,
)
from pytest_gpucanary.fleet.kubelet_nodes import KubeletNodes
from pytest_gpucanary.fleet.layout import HOST, FleetLayout
from pytest_gpucanary.fleet.pki import ensure_pki, write_kubeconfig
from pytest_gpucanary.kube import Kube

if TYPE_CHECKING:
    from pytest_gpucanary.canary.pool import PoolProvider
    from pytest_gpucanary.config import Settings

Progress = Callable[[str], None]
USER_AGENT = "gpucanary-fleet"  # not gpucanary/<version>: the audit log tells the canary apart by it
FLEET_NODE_SELECTOR = "gpucanary.io/fleet=local"  # the fleet's own node templates carry it
APPLY_CHUNK = 50
APPLY_PARALLELISM = 4
START_TIMEOUT_S = {"etcd": 30, "kube-apiserver": 120, "prometheus": 60}
SERIES_TIMEOUT_S = 120.0
NODES_READY_TIMEOUT_S = 120
HOST_ETC_MOUNTPOINT = Path("/host-etc")


def _quiet(line: str) -> None:
    pass


def _node_ready(node: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in node.get("status", {}).get("conditions") or []
    )


@dataclass(frozen=True)
class Binaries:
    control_plane: Path
    operator: Path
    kubelet_node: Path | None = None  # None: the fleet has no real kubelet nodes
    nfd_master: Path | None = None  # None: no kubelet pool, so no GFD for nfd-master to serve


@dataclass(frozen=True)
class Fleet:
    layout: FleetLayout

    @classmethod
    def from_env(cls) -> Fleet:
        return cls(FleetLayout.from_env())

    def with_gpu_nodes(self, count: int) -> Fleet:
        return replace(self, layout=self.layout.with_gpu_nodes(count))

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    @property
    def prometheus_url(self) -> str:
        return self.layout.prometheus_url

    @property
    def operator_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.layout.port('gpu-operator-metrics')}/metrics"

    @property
    def ingress_url(self) -> str:
        return f"http://{HOST}:{self.layout.port('ingress')}"

    def helm_chart(self) -> Path:
        """The gpu-operator chart of the fleet's release, which renders a Helm values policy."""
        return operator_chart(self.layout.operator_release, _quiet)

    def service_url(self, namespace: str, name: str) -> str:
        """Where a load generator reaches a Service through the fleet's ingress (no trailing slash)."""
        return f"{self.ingress_url}/svc/{namespace}/{name}"

    def _components(self, binaries: Binaries) -> list[components.Component]:
        prometheus = shutil.which("prometheus") or "prometheus"
        control_plane = components.control_plane(self.layout, binaries.control_plane)
        if binaries.kubelet_node is not None:
            control_plane = [
                kubelet_nodes.with_node_hosts(self.layout, c) if c.name == "kube-apiserver" else c
                for c in control_plane
            ]
        return control_plane + [
            components.prometheus(self.layout, prometheus),
            self._operator(binaries),
            components.node_agent(self.layout),
            self._ingress(),
        ]

    def _all_components(self, binaries: Binaries) -> list[components.Component]:
        """Everything above plus the processes of the real kubelet nodes."""
        if binaries.kubelet_node is None:
            return self._components(binaries)
        nodes = KubeletNodes.running(self.layout) or KubeletNodes.planned(self.layout, binaries.kubelet_node)
        return self._components(binaries) + nodes.components() + self._nfd_master(binaries)

    def _nfd_master(self, binaries: Binaries) -> list[components.Component]:
        if binaries.nfd_master is None:
            return []
        return [components.nfd_master(self.layout, binaries.nfd_master, manifests.CPU_NODE_NAME)]

    def _ingress(self) -> components.Component:
        port = self.layout.port("ingress")
        return components.Component(
            "ingress",
            (
                sys.executable,
                "-m",
                "pytest_gpucanary.fleet.ingress",
                f"--kubeconfig={self.layout.kubeconfig}",
                f"--port={port}",
            ),
            f"http://{HOST}:{port}/healthz",
            port,
        )

    def _operator(self, binaries: Binaries) -> components.Component:
        return components.gpu_operator(self.layout, binaries.operator)

    def binaries(self) -> Binaries | None:
        """The binaries the running (or last started) fleet uses."""
        try:
            state = json.loads(self.layout.state_file.read_text())
            kubelet_node, nfd_master = state.get("kubelet_node_bin_dir"), state.get("nfd_master_bin_dir")
            return Binaries(
                Path(state["bin_dir"]),
                Path(state["operator_bin_dir"]),
                Path(kubelet_node) if kubelet_node else None,
                Path(nfd_master) if nfd_master else None,
            )
        except (OSError, ValueError, KeyError):
            return None

    def has_kubelet_pool(self) -> bool:
        """Whether the fleet's kubelet nodes are canary pools: as the running (or last started) fleet
        was made, else as this environment would make it."""
        try:
            return bool(json.loads(self.layout.state_file.read_text())["kubelet_pool"])
        except (OSError, ValueError, KeyError):
            return self.layout.kubelet_pool and self.layout.kubelet_nodes > 0

    def pool_provider(self, settings: Settings) -> PoolProvider | None:
        """The fleet's own pool (its kubelet node where it has one as a pool, else a fresh KWOK node), or None
        for `--gpucanary-pool-provider=existing`."""
        from pytest_gpucanary.fleet.kubelet_pool import KubeletPoolProvider
        from pytest_gpucanary.fleet.kwok_pool import KwokPoolProvider

        provider = settings.pool_provider or ("kubelet" if self.has_kubelet_pool() else "kwok")
        if provider == "kwok":
            return KwokPoolProvider(size=settings.pool_size)
        if provider == "kubelet":
            return KubeletPoolProvider.for_fleet(settings, self.layout)
        return None

    def bin_dir(self) -> Path | None:
        binaries = self.binaries()
        return binaries.control_plane if binaries else None

    def is_up(self) -> bool:
        binaries = self.binaries()
        return binaries is not None and all(
            processes.pid_of(self.layout, c.name) and processes.healthy(self.layout, c)
            for c in self._all_components(binaries)
        )

    def operator_release(self) -> str | None:
        """The GPU Operator release the running (or last started) fleet runs."""
        binaries = self.binaries()
        try:
            return operator_release(binaries.operator) if binaries else None
        except OSError:
            return None

    def up(self, *, progress: Progress = _quiet) -> None:
        """Start everything that is not running; a running healthy fleet only gets its nodes ensured.

        A running fleet on another GPU Operator release is refused, not restarted: restarting would
        drop every object (and test) the running fleet holds."""
        started = time.monotonic()
        if self.is_up() or self._start_ingress_only(progress):
            self._refuse_other_release()
            progress(f"fleet: already up ({self.layout.root}, GPU Operator {self.operator_release()})")
            self._ensure_canary_prerequisites(self.kubectl)
            self._ensure_nodes(progress)
            return
        self._refuse_leftovers()
        release = self.layout.operator_release
        binaries = Binaries(
            find_bin_dir(CONTROL_PLANE, progress),
            find_operator_bin_dir(release, progress),
            kubelet_nodes.find_kubelet_bin_dir(progress) if self.layout.kubelet_nodes else None,
            find_bin_dir(NFD_MASTER, progress) if self.layout.kubelet_nodes and self.layout.kubelet_pool else None,
        )
        self._check_host(binaries)
        self._prepare(binaries)
        try:
            self._start_all(binaries, progress)
        except BaseException:
            kubelet_nodes.stop_nodes(self.layout)
            processes.stop_all(self.layout)
            raise
        elapsed_s = time.monotonic() - started
        self._save_state(binaries, startup_s=elapsed_s)
        progress(f"fleet: up in {elapsed_s:.1f} s; kubeconfig {self.kubeconfig}")

    def _refuse_other_release(self) -> None:
        running, wanted = self.operator_release(), self.layout.operator_release
        if running != wanted:
            raise EnvError(
                f"the fleet in {self.layout.root} runs GPU Operator {running}, not {wanted}",
                hint=f"run `gpucanary fleet down` first, or set GPUCANARY_OPERATOR_RELEASE={running}",
            )

    def _start_ingress_only(self, progress: Progress) -> bool:
        """A fleet started before the ingress existed gets just the ingress, not a refusal to start."""
        binaries = self.binaries()
        if binaries is None:
            return False
        *others, ingress = self._components(binaries)
        if processes.pid_of(self.layout, ingress.name) or not all(
            processes.pid_of(self.layout, c.name) and processes.healthy(self.layout, c) for c in others
        ):
            return False
        self._start(ingress, progress)
        return True

    def _check_host(self, binaries: Binaries) -> None:
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
        for part in self._all_components(binaries):
            if part.port and processes.port_in_use(part.port):
                raise EnvError(
                    f"port 127.0.0.1:{part.port} for {part.name} is already in use",
                    hint="stop what listens there or set GPUCANARY_FLEET_PORT_BASE to another base",
                )

    def _start_all(self, binaries: Binaries, progress: Progress) -> None:
        *others, operator_part, agent, ingress = self._components(binaries)
        for part in others:
            self._start(part, progress)
        self._ensure_nodes(progress, binaries.control_plane)
        if binaries.kubelet_node is not None:
            KubeletNodes.planned(self.layout, binaries.kubelet_node).start(
                self._kubectl_for(binaries.control_plane), progress, operator_bin_dir=binaries.operator
            )
        paths = read_paths_env(binaries.operator)
        progress(f"fleet: installing the GPU Operator {paths['GPU_OPERATOR_VERSION']} CRDs")
        operator.install_crds(self._kubectl_for(binaries.control_plane), Path(paths["GPU_OPERATOR_CRD_DIR"]))
        for part in self._nfd_master(binaries):  # GFD on a kubelet pool node writes NodeFeatures for it
            progress("fleet: installing NFD's CRDs")
            assert binaries.nfd_master is not None  # _nfd_master gives a part only then
            self._kubectl_for(binaries.control_plane)(
                "apply",
                "--server-side",
                "--field-manager=gpucanary-fleet",
                "-f",
                str(binaries.nfd_master / "nfd-api-crds.yaml"),
            )
            self._start(part, progress)
        self._start(operator_part, progress)
        self._start(agent, progress)
        self._start(ingress, progress)
        self._ensure_canary_prerequisites(self._kubectl_for(binaries.control_plane))
        operator.apply_policies(
            self._kubectl_for(binaries.control_plane),
            driver_mode=self.layout.driver_mode,
            release=paths["GPU_OPERATOR_VERSION"],
            rdma=self.layout.gpu_rdma,
            pool_nodes=self._kubelet_pool_nodes(binaries),
            apiserver_url=self.layout.apiserver_url,
            default_driver=self.layout.default_driver,
        )
        progress("fleet: waiting for the driver, device-plugin and validator pods on every GPU node")
        operator.wait_ready(self._kube(), self.gpu_node_names(), progress)
        self._wait_series(progress)
        if binaries.kubelet_node is not None:
            KubeletNodes.planned(self.layout, binaries.kubelet_node).wait_operator_gpus(
                self._kubectl_for(binaries.control_plane), progress
            )

    def _kubelet_pool_nodes(self, binaries: Binaries) -> tuple[str, ...]:
        if binaries.kubelet_node is None or not self.layout.kubelet_pool:
            return ()
        return tuple(node.name for node in KubeletNodes.planned(self.layout, binaries.kubelet_node).nodes())

    def _wait_series(self, progress: Progress) -> None:
        """Until Prometheus holds every series a canary's preflight asks for, so a run can follow `fleet up`
        at once (its scrapes and service discovery run every 5 s)."""
        deadline = time.monotonic() + SERIES_TIMEOUT_S
        while missing := metrics.missing_series(self.prometheus_url):
            if time.monotonic() > deadline:
                raise EnvError(
                    f"the fleet's Prometheus still lacks a series after {SERIES_TIMEOUT_S:.0f} s: {missing[0]}",
                    hint=f"see {self.layout.logs / 'prometheus.log'}",
                )
            time.sleep(1.0)

    def _start(self, part: components.Component, progress: Progress) -> None:
        progress(f"fleet: starting {part.name} {processes.where(part)}")
        proc = processes.start(self.layout, part)
        processes.wait_healthy(self.layout, part, proc, timeout_s=START_TIMEOUT_S.get(part.name, 60))

    def component(self, name: str) -> components.Component:
        binaries = self.binaries()
        if binaries is None:
            raise EnvError(f"no fleet state in {self.layout.root}", hint="run `gpucanary fleet up` first")
        try:
            return next(c for c in self._components(binaries) if c.name == name)
        except StopIteration:
            raise EnvError(
                f"the fleet has no component {name!r}", hint=f"one of {', '.join(processes.STOP_ORDER)}"
            ) from None

    def stop_component(self, name: str) -> None:
        """Stop one process of a running fleet (a fault for tests; `start_component` brings it back)."""
        processes.stop_one(self.layout, name)

    def start_component(self, name: str, *, progress: Progress = _quiet) -> None:
        self._start(self.component(name), progress)

    def restart_component(self, name: str, *, progress: Progress = _quiet) -> None:
        """Stop one component and start it again with the same command line and data, healthy on return."""
        part = self.component(name)
        processes.stop_one(self.layout, name)
        self._start(part, progress)

    def pause_component(self, name: str) -> None:
        """SIGSTOP one component (etcd: the apiserver's storage hangs); `resume_component` continues it."""
        processes.pause(self.layout, name)

    def resume_component(self, name: str) -> None:
        processes.resume(self.layout, name)

    def _refuse_leftovers(self) -> None:
        leftovers = processes.owned_pids(self.layout)
        if leftovers:
            raise EnvError(
                f"a previous fleet in {self.layout.root} is half-started ({len(leftovers)} processes "
                "still running, not all healthy)",
                hint="run `gpucanary fleet down` first",
            )

    def _prepare(self, binaries: Binaries) -> None:
        layout = self.layout
        layout.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(layout.data, ignore_errors=True)
        layout.data.mkdir(parents=True)
        ensure_pki(layout.pki)
        if binaries.kubelet_node is not None:
            kubelet_nodes.write_hosts(layout)
        write_kubeconfig(layout.kubeconfig, server=layout.apiserver_url, pki=layout.pki)
        (layout.root / "kwok.yaml").write_text(
            manifests.kwok_config(binaries.control_plane, gpu_nodes=layout.gpu_nodes)
        )
        (layout.root / "prometheus.yml").write_text(manifests.prometheus_config(layout))
        layout.audit_policy.write_text(manifests.audit_policy())
        self._prepare_operator_files(read_paths_env(binaries.operator))
        self._save_state(binaries, startup_s=None)

    def _prepare_operator_files(self, paths: dict[str, str]) -> None:
        """Unedited copies of the operator's manifests and a host os-release, as its image would have."""
        opt = self.layout.root / "opt" / "gpu-operator"
        shutil.rmtree(opt.parent, ignore_errors=True)
        shutil.copytree(paths["GPU_OPERATOR_ASSETS_DIR"], opt)
        shutil.copytree(paths["GPU_OPERATOR_MANIFESTS_DIR"], opt / "manifests")
        host_etc = self.layout.root / "host-etc"
        host_etc.mkdir(exist_ok=True)
        shutil.copy(manifests.FLEET_FIXTURES / "host-etc" / "os-release", host_etc / "os-release")
        HOST_ETC_MOUNTPOINT.mkdir(exist_ok=True)  # an empty mount point; the fleet's copy is mounted on it

    def _save_state(self, binaries: Binaries, *, startup_s: float | None) -> None:
        state = {
            "bin_dir": str(binaries.control_plane),
            "operator_bin_dir": str(binaries.operator),
            "operator_release": operator_release(binaries.operator),
            "driver_mode": self.layout.driver_mode,
            "gpu_nodes": self.layout.gpu_nodes,
            "startup_s": startup_s,
            "kubeconfig": str(self.kubeconfig),
            "prometheus_url": self.prometheus_url,
            "kubelet_pool": bool(self._kubelet_pool_nodes(binaries)),
            "kubelet_node_bin_dir": str(binaries.kubelet_node) if binaries.kubelet_node else None,
            "nfd_master_bin_dir": str(binaries.nfd_master) if binaries.nfd_master else None,
        }
        self.layout.state_file.write_text(json.dumps(state, indent=2) + "\n")

    @staticmethod
    def _ensure_canary_prerequisites(kubectl: Callable[..., str]) -> None:
        """The PriorityClass every canary pod names and the namespace that keeps verdicts
        (deploy/priorityclass.yaml and deploy/rbac.yaml on a real cluster)."""
        verdicts = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": VERDICT_NAMESPACE}}
        kubectl(
            "apply",
            "-f",
            "-",
            stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [PRIORITY_CLASS_MANIFEST, verdicts]}),
        )

    def _kubectl_for(self, bin_dir: Path) -> Callable[..., str]:
        return lambda *args, **kwargs: self.kubectl(*args, bin_dir=bin_dir, **kwargs)

    def kubectl(self, *args: str, stdin: str | None = None, timeout_s: float = 60, bin_dir: Path | None = None) -> str:
        binary = (bin_dir or self.bin_dir() or Path("/nonexistent")) / "kubectl"
        result = subprocess.run(
            [str(binary), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if result.returncode != 0:
            raise EnvError(f"kubectl {' '.join(args[:2])} failed: {result.stderr.strip()[:300]}")
        return result.stdout

    def gpu_node_names(self) -> list[str]:
        return [manifests.gpu_node_name(i) for i in range(self.layout.gpu_nodes)]

    def _kube(self) -> Kube:
        return Kube.connect(self.kubeconfig, user_agent=USER_AGENT)

    def _ensure_nodes(self, progress: Progress, bin_dir: Path | None = None) -> None:
        """Create the fleet's nodes that do not exist yet and wait until every one is Ready.

        Server-side apply in chunks, a few kubectl processes at a time: one kubectl applies its
        objects one request after another, which takes minutes for 1,000 nodes on 2 cores.
        """
        nodes = manifests.fleet_nodes(self.layout)
        kube = self._kube()
        existing = {n["metadata"]["name"] for n in kube.list("v1", "Node", label_selector=FLEET_NODE_SELECTOR)}
        missing = [n for n in nodes if n["metadata"]["name"] not in existing]
        progress(f"fleet: ensuring {self.layout.gpu_nodes} GPU nodes and 1 CPU node ({len(missing)} to create)")
        chunks = [missing[i : i + APPLY_CHUNK] for i in range(0, len(missing), APPLY_CHUNK)]
        with ThreadPoolExecutor(max_workers=APPLY_PARALLELISM) as pool:
            list(
                pool.map(
                    lambda chunk: self.kubectl(
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
            raise EnvError(str(exc)[:300], hint=f"see {self.layout.logs / 'kwok.log'}") from None
        self._wait_default_service_account(bin_dir)

    def _wait_default_service_account(self, bin_dir: Path | None) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                self.kubectl("get", "serviceaccount", "default", "-n", "default", bin_dir=bin_dir)
                return
            except EnvError:
                if time.monotonic() > deadline:
                    raise EnvError(
                        "the default ServiceAccount never appeared",
                        hint=f"see {self.layout.logs / 'kube-controller-manager.log'}",
                    ) from None
                time.sleep(0.5)

    def status(self) -> dict[str, str]:
        binaries = self.binaries()
        if binaries is None:
            return {"fleet": "stopped"}
        paths = read_paths_env(binaries.operator) if (binaries.operator / "paths.env").exists() else {}
        states = {
            "gpu-operator release": "{} (commit {}, from {}; {} mode)".format(
                paths.get("GPU_OPERATOR_VERSION", "unknown"),
                paths.get("GPU_OPERATOR_COMMIT", "unknown"),
                paths.get("GPU_OPERATOR_SOURCE", "unknown"),
                self._driver_mode(),
            ),
            "default canary pool": "kubelet: the real kubelet pool nodes"
            if self.has_kubelet_pool()
            else "kwok: a fresh KWOK GPU node per run",
        }
        for part in self._all_components(binaries):
            pid = processes.pid_of(self.layout, part.name)
            if pid is None:
                states[part.name] = "stopped"
            else:
                health = "healthy" if processes.healthy(self.layout, part) else "not answering"
                where = f"127.0.0.1:{part.port}" if part.port else "no port"
                states[part.name] = f"running (pid {pid}, {where}, {health})"
        if all(
            s.startswith("running")
            for name, s in states.items()
            if name not in ("gpu-operator release", "default canary pool")
        ):
            states["nodes"] = self._node_summary()
        return states

    def _driver_mode(self) -> str:
        try:
            return json.loads(self.layout.state_file.read_text()).get("driver_mode", "unknown")
        except (OSError, ValueError):
            return "unknown"

    def nodes(self) -> list[dict[str, str]]:
        """One row per node: name, Ready, allocatable GPUs, GPU product, upgrade state."""
        rows = []
        for node in json.loads(self.kubectl("get", "nodes", "-o", "json"))["items"]:
            labels = node["metadata"].get("labels", {})
            ready = next((c["status"] for c in node["status"].get("conditions", []) if c["type"] == "Ready"), "Unknown")
            rows.append(
                {
                    "name": node["metadata"]["name"],
                    "ready": ready,
                    "gpus": node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0"),
                    "product": labels.get("nvidia.com/gpu.product", ""),
                    "upgrade": labels.get("nvidia.com/gpu-driver-upgrade-state", ""),
                }
            )
        return rows

    def _node_summary(self) -> str:
        rows = self.nodes()
        ready = sum(1 for row in rows if row["ready"] == "True")
        gpus = sum(int(row["gpus"]) for row in rows)
        return f"{ready}/{len(rows)} Ready, {gpus} nvidia.com/gpu allocatable"

    def down(self, *, progress: Progress = _quiet) -> None:
        binaries = self.binaries()
        ports = [p.port for p in self._all_components(binaries) if p.port] if binaries else []
        kubelet_nodes.stop_nodes(self.layout, progress)
        stopped = processes.stop_all(self.layout)
        progress(f"fleet: stopped {len(stopped)} processes")
        deadline = time.monotonic() + 5
        while (busy := [port for port in ports if processes.port_in_use(port)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if busy:
            raise EnvError(f"ports still listening after fleet down: {busy}", hint="find the owner with `ss -ltnp`")
        shutil.rmtree(self.layout.data, ignore_errors=True)
        self.layout.state_file.unlink(missing_ok=True)
