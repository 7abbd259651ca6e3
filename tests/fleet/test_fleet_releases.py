"""The fleet runs the GPU Operator release it is asked for, in both driver modes, from that release's
own tree: its binary (stamped with its version), every CRD of its chart, its assets and manifests.

The session fleet is checked in full. Fresh one-node fleets on other releases are a smoke (up, what
the cluster holds, a refused up on another release, down leaving nothing): by default only the
session's release runs, in both modes; GPUCANARY_E2E_OPERATOR_RELEASES=all (or a comma list) adds
the others. A release not built yet is built first (minutes), so CI should warm the cache.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from pytest_gpucanary.fleet import processes
from pytest_gpucanary.fleet.binaries import read_paths_env
from pytest_gpucanary.fleet.layout import FleetLayout, OPERATOR_RELEASES
from pytest_gpucanary.kube import Kube
from harness import gpucanary, port_beside_session, second_fleet_env

pytestmark = pytest.mark.e2e

SESSION_RELEASE = os.environ.get("GPUCANARY_OPERATOR_RELEASE") or OPERATOR_RELEASES[0]
# A base of its own beside the session fleet's, away from the other e2e modules' second fleets.
PORT_BASE = port_beside_session("releases")


def _releases() -> list[str]:
    wanted = os.environ.get("GPUCANARY_E2E_OPERATOR_RELEASES", "")
    if wanted == "all":
        return list(OPERATOR_RELEASES)
    extra = [r.strip() for r in wanted.split(",") if r.strip()]
    unknown = [r for r in extra if r not in OPERATOR_RELEASES]
    if unknown:
        raise pytest.UsageError(f"GPUCANARY_E2E_OPERATOR_RELEASES names {unknown[0]!r}; use all or a comma list "
                                f"of {', '.join(OPERATOR_RELEASES)}")
    return [SESSION_RELEASE] + [r for r in extra if r != SESSION_RELEASE]


def crd_names(crd_dir: Path) -> set[str]:
    return {yaml.safe_load(path.read_text())["metadata"]["name"] for path in crd_dir.glob("*.yaml")}


def assert_runs_release(kube: Kube, fleet_dir: Path, paths: dict[str, str], release: str) -> None:
    """What the cluster and the operator's own log say about the release that runs."""
    assert paths["GPU_OPERATOR_VERSION"] == release
    log = (fleet_dir / "logs" / "gpu-operator.log").read_text()
    assert f'"version: {release}, commit: {paths["GPU_OPERATOR_COMMIT"]}"' in log
    installed = {crd["metadata"]["name"] for crd in kube.list("apiextensions.k8s.io/v1", "CustomResourceDefinition")}
    assert crd_names(Path(paths["GPU_OPERATOR_CRD_DIR"])) <= installed
    if release == "v26.7.0":
        assert "gpuclusters.nvidia.com" in installed   # its controller exits without it (v26.3.3 has none)
    policy = kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")
    assert policy["metadata"]["labels"]["app.kubernetes.io/version"] == release
    assert policy["metadata"]["labels"]["helm.sh/chart"] == f"gpu-operator-{release}"


def test_session_fleet_runs_the_chosen_release_from_one_tree(gpucanary_fleet, kube: Kube) -> None:
    fleet = gpucanary_fleet.fleet
    binaries = fleet.binaries()
    paths = read_paths_env(binaries.operator)
    tree = Path(paths["GPU_OPERATOR_MODULE_DIR"])
    for key in ("GPU_OPERATOR_ASSETS_DIR", "GPU_OPERATOR_MANIFESTS_DIR", "GPU_OPERATOR_CRD_DIR"):
        assert Path(paths[key]).is_relative_to(tree), key
    assert fleet.operator_release() == SESSION_RELEASE
    assert_runs_release(kube, fleet.layout.root, paths, SESSION_RELEASE)
    status = gpucanary("fleet", "status", unbuffered=False)
    assert status.returncode == 0, status.stderr
    assert f"gpu-operator release     {SESSION_RELEASE} (commit {paths['GPU_OPERATOR_COMMIT']}" in status.stdout


@pytest.mark.slow
@pytest.mark.parametrize("driver_mode", ["nvidiadriver", "clusterpolicy"])
@pytest.mark.parametrize("release", _releases())
def test_fleet_up_runs_release(release: str, driver_mode: str, gpucanary_fleet, tmp_path: Path,
                              record_property) -> None:
    env = second_fleet_env("releases", tmp_path / "fleet", gpucanary_fleet, GPUCANARY_FLEET_GPU_NODES="1",
                           GPUCANARY_FLEET_DRIVER_MODE=driver_mode, GPUCANARY_OPERATOR_RELEASE=release,
                           GPUCANARY_OPERATOR_BIN_DIR="")   # the cached build of `release`, built if missing
    layout = FleetLayout(root=(tmp_path / "fleet").resolve(), port_base=PORT_BASE)
    up = gpucanary("fleet", "up", env=env, unbuffered=False)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        # the fleet's own figure (monotonic clock, from start to operands Ready), kept in the JUnit report
        up_s = re.search(r"^fleet: up in ([0-9.]+) s", up.stderr, re.MULTILINE)
        assert up_s, up.stderr[-2000:]
        record_property("fleet_up_s", float(up_s.group(1)))
        status = gpucanary("fleet", "status", env=env, unbuffered=False)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"gpu-operator release     {release} (" in status.stdout
        assert f"{driver_mode} mode)" in status.stdout
        kube = Kube.connect(up.stdout.strip().splitlines()[-1])
        operator_dir = Path(json.loads(layout.state_file.read_text())["operator_bin_dir"])
        assert_runs_release(kube, layout.root, read_paths_env(operator_dir), release)
        policy = kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")
        assert policy["spec"]["driver"]["useNvidiaDriverCRD"] is (driver_mode == "nvidiadriver")
        driver = ("app.kubernetes.io/component=nvidia-driver" if driver_mode == "nvidiadriver"
                  else "app=nvidia-driver-daemonset")
        assert [p["spec"]["nodeName"] for p in kube.list("v1", "Pod", label_selector=driver)] == ["gpu-node-0"]

        other = next(r for r in OPERATOR_RELEASES if r != release)
        refused = gpucanary("fleet", "up", env={**env, "GPUCANARY_OPERATOR_RELEASE": other}, unbuffered=False)
        assert refused.returncode == 6, refused.stderr
        assert refused.stderr.strip().splitlines()[-1] == (
            f"gpucanary: error: the fleet in {layout.root} runs GPU Operator {release}, not {other}; run "
            f"`gpucanary fleet down` first, or set GPUCANARY_OPERATOR_RELEASE={release}")
    finally:
        down = gpucanary("fleet", "down", env=env, unbuffered=False)
    assert down.returncode == 0, down.stderr
    assert processes.owned_pids(layout) == []
    assert [port for port in range(PORT_BASE, PORT_BASE + 100) if processes.port_in_use(port)] == []


def test_unknown_release_is_refused_in_one_line(tmp_path: Path) -> None:
    result = gpucanary("fleet", "up", env={"GPUCANARY_FLEET_DIR": str(tmp_path / "fleet"),
                                           "GPUCANARY_OPERATOR_RELEASE": "v24.9.2"}, unbuffered=False)
    assert result.returncode == 4, result.stderr
    assert result.stderr.strip().splitlines() == [
        "gpucanary: error: GPUCANARY_OPERATOR_RELEASE='v24.9.2' is not a release the fleet can run; use one of "
        + ", ".join(OPERATOR_RELEASES)]


def test_missing_source_archive_is_refused_in_one_line(gpucanary_fleet, tmp_path: Path) -> None:
    env = second_fleet_env("releases", tmp_path / "fleet", gpucanary_fleet,
                           GPUCANARY_OPERATOR_RELEASE="v26.3.3", GPUCANARY_OPERATOR_BIN_DIR="",
                           GPUCANARY_OPERATOR_ARCHIVE_DIR=str(tmp_path / "none"),
                           GPUCANARY_CACHE=str(tmp_path / "cache"),   # no earlier build of the release to fall back on
                           GPUCANARY_FLEET_KUBELET_NODES="0")
    result = gpucanary("fleet", "up", env=env, unbuffered=False)
    assert result.returncode == 6, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gpucanary: error: build-operator.sh failed: no source archive for GPU Operator v26.3.3 "
                           f"at {tmp_path / 'none' / 'gpu-operator-v26.3.3.tar.gz'}"), last
    assert "Traceback" not in result.stderr
    assert processes.owned_pids(FleetLayout(root=(tmp_path / "fleet").resolve(), port_base=PORT_BASE)) == []
