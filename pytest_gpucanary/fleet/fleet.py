"""The local GPU fleet: a real control plane on 127.0.0.1 with KWOK GPU nodes and Prometheus.

Owns the processes it starts and the fleet directory; never touches any other cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import yaml

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet import components, manifests, processes
from pytest_gpucanary.fleet.binaries import find_bin_dir
from pytest_gpucanary.fleet.layout import FleetLayout
from pytest_gpucanary.fleet.pki import ensure_pki, write_kubeconfig

Progress = Callable[[str], None]
START_TIMEOUT_S = {"etcd": 30, "kube-apiserver": 120, "prometheus": 60}
NODES_READY_TIMEOUT_S = 120


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

    def _components(self, bin_dir: Path) -> list[components.Component]:
        prometheus = shutil.which("prometheus") or "prometheus"
        return components.control_plane(self.layout, bin_dir) + [components.prometheus(self.layout, prometheus)]

    def bin_dir(self) -> Path | None:
        """The binary directory the running (or last started) fleet uses."""
        try:
            return Path(json.loads(self.layout.state_file.read_text())["bin_dir"])
        except (OSError, ValueError, KeyError):
            return None

    def is_up(self) -> bool:
        bin_dir = self.bin_dir()
        return bin_dir is not None and all(
            processes.pid_of(self.layout, c.name) and processes.healthy(self.layout, c)
            for c in self._components(bin_dir))

    def up(self, *, progress: Progress = _quiet) -> None:
        """Start everything that is not running; a running healthy fleet only gets its nodes ensured."""
        started = time.monotonic()
        if self.is_up():
            progress(f"fleet: already up ({self.layout.root})")
            self._ensure_nodes(self.bin_dir(), progress)
            return
        self._refuse_leftovers()
        bin_dir = find_bin_dir(progress)
        if shutil.which("prometheus") is None:
            raise EnvError("prometheus is not installed", hint="apt-get install prometheus")
        parts = self._components(bin_dir)
        for part in parts:
            if processes.port_in_use(part.port):
                raise EnvError(f"port 127.0.0.1:{part.port} for {part.name} is already in use",
                               hint="stop what listens there or set GPUCANARY_FLEET_PORT_BASE to another base")
        self._prepare(bin_dir)
        try:
            for part in parts:
                progress(f"fleet: starting {part.name} on 127.0.0.1:{part.port}")
                proc = processes.start(self.layout, part)
                processes.wait_healthy(self.layout, part, proc, timeout_s=START_TIMEOUT_S.get(part.name, 60))
            self._ensure_nodes(bin_dir, progress)
        except BaseException:
            processes.stop_all(self.layout)
            raise
        elapsed_s = time.monotonic() - started
        self._save_state(bin_dir, startup_s=elapsed_s)
        progress(f"fleet: up in {elapsed_s:.1f} s; kubeconfig {self.kubeconfig}")

    def _refuse_leftovers(self) -> None:
        leftovers = processes.owned_pids(self.layout)
        if leftovers:
            raise EnvError(f"a previous fleet in {self.layout.root} is half-started ({len(leftovers)} processes "
                           "still running, not all healthy)", hint="run `gpucanary fleet down` first")

    def _prepare(self, bin_dir: Path) -> None:
        layout = self.layout
        layout.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(layout.data, ignore_errors=True)
        layout.data.mkdir(parents=True)
        ensure_pki(layout.pki)
        write_kubeconfig(layout.kubeconfig, server=layout.apiserver_url, pki=layout.pki)
        (layout.root / "kwok.yaml").write_text(manifests.kwok_config(bin_dir))
        (layout.root / "prometheus.yml").write_text(manifests.prometheus_config(layout))
        self._save_state(bin_dir, startup_s=None)

    def _save_state(self, bin_dir: Path, *, startup_s: float | None) -> None:
        state = {"bin_dir": str(bin_dir), "gpu_nodes": self.layout.gpu_nodes, "startup_s": startup_s,
                 "kubeconfig": str(self.kubeconfig), "prometheus_url": self.prometheus_url}
        self.layout.state_file.write_text(json.dumps(state, indent=2) + "\n")

    def kubectl(self, *args: str, stdin: str | None = None, timeout_s: float = 60,
                bin_dir: Path | None = None) -> str:
        binary = (bin_dir or self.bin_dir() or Path("/nonexistent")) / "kubectl"
        result = subprocess.run([str(binary), f"--kubeconfig={self.kubeconfig}", *args], input=stdin,
                                capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise EnvError(f"kubectl {' '.join(args[:2])} failed: {result.stderr.strip()[:300]}")
        return result.stdout

    def _ensure_nodes(self, bin_dir: Path | None, progress: Progress) -> None:
        nodes = manifests.fleet_nodes(self.layout)
        progress(f"fleet: ensuring {self.layout.gpu_nodes} GPU nodes and 1 CPU node")
        self.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=gpucanary-fleet", "-f", "-",
                     stdin=yaml.safe_dump_all(nodes), bin_dir=bin_dir)
        names = [n["metadata"]["name"] for n in nodes]
        self.kubectl("wait", "--for=condition=Ready", f"--timeout={NODES_READY_TIMEOUT_S}s",
                     *(f"node/{name}" for name in names), timeout_s=NODES_READY_TIMEOUT_S + 10, bin_dir=bin_dir)
        self._wait_default_service_account(bin_dir)

    def _wait_default_service_account(self, bin_dir: Path | None) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                self.kubectl("get", "serviceaccount", "default", "-n", "default", bin_dir=bin_dir)
                return
            except EnvError:
                if time.monotonic() > deadline:
                    raise EnvError("the default ServiceAccount never appeared",
                                   hint=f"see {self.layout.logs / 'kube-controller-manager.log'}") from None
                time.sleep(0.5)

    def status(self) -> dict[str, str]:
        bin_dir = self.bin_dir()
        if bin_dir is None:
            return {"fleet": "stopped"}
        states = {}
        for part in self._components(bin_dir):
            pid = processes.pid_of(self.layout, part.name)
            if pid is None:
                states[part.name] = "stopped"
            else:
                health = "healthy" if processes.healthy(self.layout, part) else "not answering"
                states[part.name] = f"running (pid {pid}, 127.0.0.1:{part.port}, {health})"
        if all(s.startswith("running") for s in states.values()):
            states["nodes"] = self._node_summary()
        return states

    def nodes(self) -> list[dict[str, str]]:
        """One row per node: name, Ready, allocatable GPUs, GPU product (empty on CPU nodes)."""
        rows = []
        for node in json.loads(self.kubectl("get", "nodes", "-o", "json"))["items"]:
            ready = next((c["status"] for c in node["status"].get("conditions", []) if c["type"] == "Ready"), "Unknown")
            rows.append({"name": node["metadata"]["name"], "ready": ready,
                         "gpus": node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0"),
                         "product": node["metadata"]["labels"].get("nvidia.com/gpu.product", "")})
        return rows

    def _node_summary(self) -> str:
        rows = self.nodes()
        ready = sum(1 for row in rows if row["ready"] == "True")
        gpus = sum(int(row["gpus"]) for row in rows)
        return f"{ready}/{len(rows)} Ready, {gpus} nvidia.com/gpu allocatable"

    def down(self, *, progress: Progress = _quiet) -> None:
        stopped = processes.stop_all(self.layout)
        progress(f"fleet: stopped {len(stopped)} processes")
        bin_dir = self.bin_dir()
        ports = [p.port for p in self._components(bin_dir)] if bin_dir else []
        deadline = time.monotonic() + 5
        while (busy := [port for port in ports if processes.port_in_use(port)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if busy:
            raise EnvError(f"ports still listening after fleet down: {busy}", hint="find the owner with `ss -ltnp`")
        shutil.rmtree(self.layout.data, ignore_errors=True)
        self.layout.state_file.unlink(missing_ok=True)
