"""pytest-kubernetes' cluster manager driving the local fleet.

pytest-kubernetes has no provider registry, so this subclass is instantiated directly by our
session fixture. Its `delete()` stops the fleet only when this manager started it.
"""

from __future__ import annotations

import os

from pytest_kubernetes.options import ClusterOptions
from pytest_kubernetes.providers.base import AClusterManager

from pytest_gpucanary.fleet.fleet import Fleet, _quiet
from pytest_gpucanary.fleet.startup import Progress


class FleetClusterManager(AClusterManager):
    def __init__(self, fleet: Fleet, *, progress: Progress = _quiet) -> None:
        self.fleet = fleet
        self._progress = progress
        super().__init__(cluster_name="gpucanary-fleet", kubeconfig=fleet.kubeconfig)

    @classmethod
    def get_binary_name(cls) -> str:
        return "kubectl"

    def _ensure_executable(self) -> None:
        """kubectl comes from the fleet's own build, which may not exist before `create()`."""

    def create(self, cluster_options: ClusterOptions | None = None, timeout: int = 60, **kwargs) -> None:
        # The base class probes readiness with kubectl before the fleet exists; ask the fleet instead.
        self._created = not self.fleet.is_up()
        self._on_create(self._cluster_options, **kwargs)
        # pytest-kubernetes runs `kubectl` from PATH: make it the fleet's own, version-matched one.
        bin_dir = str(self.fleet.bin_dir())
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        if not self.ready(timeout):
            raise RuntimeError(f"fleet {self.fleet.layout.root} started but is not ready")

    def _on_create(self, cluster_options: ClusterOptions, **kwargs) -> None:
        self.fleet.up(progress=self._progress)

    def _on_delete(self) -> None:
        self.fleet.down(progress=self._progress)

    def delete(self) -> None:
        # The base class also unlinks the kubeconfig; the fleet owns that file.
        if self._created:
            self._on_delete()

    def load_image(self, image: str) -> None:
        """KWOK nodes run no containers, so there is nothing to load."""
