"""The local GPU fleet: a real control plane on 127.0.0.1 with KWOK GPU nodes, the real NVIDIA GPU
Operator controller and Prometheus.

Owns the processes it starts and the fleet directory; never touches any other cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet import components, kubelet_nodes, manifests, processes, startup
from pytest_gpucanary.fleet.binaries import (
    CONTROL_PLANE,
    NFD_MASTER,
    Binaries,
    find_bin_dir,
    find_operator_bin_dir,
    operator_chart,
    operator_release,
    read_paths_env,
)
from pytest_gpucanary.fleet.components import Component
from pytest_gpucanary.fleet.kubelet_nodes import KubeletNodes
from pytest_gpucanary.fleet.layout import HOST, FleetLayout
from pytest_gpucanary.fleet.startup import Progress

if TYPE_CHECKING:
    from pytest_gpucanary.canary.pool import PoolProvider
    from pytest_gpucanary.config import Settings


def _quiet(line: str) -> None:
    pass


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

    def components(self, binaries: Binaries) -> list[Component]:
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

    def all_components(self, binaries: Binaries) -> list[Component]:
        """Everything above plus the processes of the real kubelet nodes."""
        if binaries.kubelet_node is None:
            return self.components(binaries)
        nodes = KubeletNodes.running(self.layout) or KubeletNodes.planned(self.layout, binaries.kubelet_node)
        return self.components(binaries) + nodes.components() + self.nfd_master(binaries)

    def nfd_master(self, binaries: Binaries) -> list[Component]:
        if binaries.nfd_master is None:
            return []
        return [components.nfd_master(self.layout, binaries.nfd_master, manifests.CPU_NODE_NAME)]

    def _ingress(self) -> Component:
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

    def _operator(self, binaries: Binaries) -> Component:
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
            for c in self.all_components(binaries)
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
        if self.is_up() or startup.start_ingress_only(self, progress):
            startup.refuse_other_release(self)
            progress(f"fleet: already up ({self.layout.root}, GPU Operator {self.operator_release()})")
            startup.ensure_canary_prerequisites(self.kubectl)
            startup.ensure_nodes(self, progress)
            return
        startup.refuse_leftovers(self)
        release = self.layout.operator_release
        binaries = Binaries(
            find_bin_dir(CONTROL_PLANE, progress),
            find_operator_bin_dir(release, progress),
            kubelet_nodes.find_kubelet_bin_dir(progress) if self.layout.kubelet_nodes else None,
            find_bin_dir(NFD_MASTER, progress) if self.layout.kubelet_nodes and self.layout.kubelet_pool else None,
        )
        startup.check_host(self, binaries)
        startup.prepare(self, binaries)
        try:
            startup.start_all(self, binaries, progress)
        except BaseException:
            kubelet_nodes.stop_nodes(self.layout)
            processes.stop_all(self.layout)
            raise
        elapsed_s = time.monotonic() - started
        startup.save_state(self, binaries, startup_s=elapsed_s)
        progress(f"fleet: up in {elapsed_s:.1f} s; kubeconfig {self.kubeconfig}")

    def component(self, name: str) -> Component:
        binaries = self.binaries()
        if binaries is None:
            raise EnvError(f"no fleet state in {self.layout.root}", hint="run `gpucanary fleet up` first")
        try:
            return next(c for c in self.components(binaries) if c.name == name)
        except StopIteration:
            raise EnvError(
                f"the fleet has no component {name!r}", hint=f"one of {', '.join(processes.STOP_ORDER)}"
            ) from None

    def stop_component(self, name: str) -> None:
        """Stop one process of a running fleet (a fault for tests; `start_component` brings it back)."""
        processes.stop_one(self.layout, name)

    def start_component(self, name: str, *, progress: Progress = _quiet) -> None:
        startup.start(self, self.component(name), progress)

    def restart_component(self, name: str, *, progress: Progress = _quiet) -> None:
        """Stop one component and start it again with the same command line and data, healthy on return."""
        part = self.component(name)
        processes.stop_one(self.layout, name)
        startup.start(self, part, progress)

    def pause_component(self, name: str) -> None:
        """SIGSTOP one component (etcd: the apiserver's storage hangs); `resume_component` continues it."""
        processes.pause(self.layout, name)

    def resume_component(self, name: str) -> None:
        processes.resume(self.layout, name)

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
        for part in self.all_components(binaries):
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
        ports = [p.port for p in self.all_components(binaries) if p.port] if binaries else []
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
