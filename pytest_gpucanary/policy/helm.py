"""Real Helm for gpu-operator Helm values: find the helm binary and the chart, run `helm template`.

Owns the subprocess; never looks inside what it renders (`policy.render` picks the ClusterPolicy
out, `policy.parse` reads it). Runs before preflight, so bad values or a missing chart never reach
the cluster. Which helm: --gpucanary-helm-binary, else `helm` on PATH (the helm that deploys the
chart renders what gets deployed), else the pinned build of ci/build-helm.sh (a checkout with Go;
`make build` makes it, a warm cache builds nothing). Which chart: --gpucanary-helm-chart (a
directory or a packaged .tgz), else, with the local fleet as the target, its release's chart.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import ConfigError, EnvError
from pytest_gpucanary.policy.render import Rendered
from pytest_gpucanary.shipped import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "ci" / "build-helm.sh"
RELEASE_NAME, NAMESPACE = "gpu-operator", "gpu-operator"  # the chart's documented install
TEMPLATE_TIMEOUT_S = 60.0  # a render takes well under 1 s; a hang is a broken helm
BUILD_TIMEOUT_S = 900.0  # a cold build takes about a minute on 2 cores


@dataclass(frozen=True)
class HelmChart:
    """A `ValuesRenderer`: `helm template` of one chart. Nothing is looked up until a values file
    needs rendering, so ClusterPolicy and NVIDIADriver runs never need helm."""

    chart: Path | None = None
    binary: Path | None = None
    fleet_chart: Callable[[], Path] | None = None  # the local fleet's release chart, when it is the target

    @classmethod
    def from_settings(cls, settings: Settings, *, fleet_chart: Callable[[], Path] | None = None) -> HelmChart:
        return cls(settings.helm_chart, settings.helm_binary, fleet_chart)

    def render(self, values_text: str, *, source: str) -> Rendered:
        chart, helm = self._chart(), self._binary()
        command = [helm, "template", RELEASE_NAME, str(chart), "--namespace", NAMESPACE, "--values", "-"]
        try:
            done = subprocess.run(
                command, input=values_text, capture_output=True, text=True, timeout=TEMPLATE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise EnvError(
                f"helm template of {chart} took over {TEMPLATE_TIMEOUT_S:.0f} s",
                hint=f"check {helm} by hand, or give another with {flag('helm_binary')}",
            ) from None
        if done.returncode != 0:
            first = next((line.strip() for line in done.stderr.splitlines() if line.strip()), "no output")
            raise ConfigError(
                f"{source}: helm template of {chart} failed: {first[:300]}",
                hint=f"fix the values file or the chart; `{helm} template {RELEASE_NAME} {chart} "
                f"-f {source}` shows all of it",
            )
        return Rendered(str(chart), done.stdout)

    def _chart(self) -> Path:
        if self.chart is None and self.fleet_chart is not None:
            return self.fleet_chart()
        if self.chart is None:
            raise ConfigError(
                "gpu-operator Helm values need the chart that renders them",
                hint=f"pass {flag('helm_chart')}=PATH: the gpu-operator chart of the cluster's "
                "release, a directory or a packaged .tgz",
            )
        return check_chart(self.chart)

    def _binary(self) -> str:
        if self.binary is not None:
            if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
                raise ConfigError(
                    f"{flag('helm_binary')}={str(self.binary)!r} is not an executable file",
                    hint="give the path of a helm v3 binary",
                )
            return str(self.binary)
        return shutil.which("helm") or build_helm()


def check_chart(chart: Path) -> Path:
    if (chart / "Chart.yaml").is_file() or (chart.is_file() and chart.name.endswith((".tgz", ".tar.gz"))):
        return chart
    problem = "does not exist" if not chart.exists() else "is neither a chart directory (with Chart.yaml) nor a .tgz"
    raise ConfigError(
        f"{flag('helm_chart')}={str(chart)!r} {problem}",
        hint="give the gpu-operator chart of the cluster's release (deployments/gpu-operator in its "
        "source, or the packaged chart)",
    )


def build_helm() -> str:
    """The pinned helm from ci/build-helm.sh (a warm cache answers at once)."""
    if not BUILD_SCRIPT.exists() or shutil.which("go") is None:
        raise EnvError(
            "helm is not on PATH and cannot be built here (no checkout with Go)",
            hint=f"install helm v3 or give one with {flag('helm_binary')}=PATH",
        )
    try:
        done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EnvError(
            f"{BUILD_SCRIPT.name} took over {BUILD_TIMEOUT_S:.0f} s",
            hint=f"run bash {BUILD_SCRIPT} to see why, or give a helm with {flag('helm_binary')}",
        ) from None
    tail = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("go: downloading")]
    if done.returncode != 0 or not done.stdout.strip():
        raise EnvError(
            f"{BUILD_SCRIPT.name} failed: {tail[-1] if tail else 'no output'}",
            hint=f"run bash {BUILD_SCRIPT} to see the whole log, or give a helm with {flag('helm_binary')}",
        )
    return done.stdout.strip().splitlines()[-1]
