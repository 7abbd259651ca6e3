"""The fleet's choice of GPU Operator release, without a cluster: the setting, the build script's
refusals and cache hits, the CRD set, and when a ClusterPolicy counts as ready."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.fleet.layout import DEFAULT_OPERATOR_RELEASE, OPERATOR_RELEASES, FleetLayout
from pytest_gpucanary.fleet.operator import crd_files, policy_ready, release_labels

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "build-operator.sh"


def build(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env})


def test_release_setting_defaults_to_v26_7_0_and_refuses_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUCANARY_OPERATOR_RELEASE", raising=False)
    assert FleetLayout.from_env().operator_release == DEFAULT_OPERATOR_RELEASE == "v26.7.0"
    monkeypatch.setenv("GPUCANARY_OPERATOR_RELEASE", "v25.10.1")
    assert FleetLayout.from_env().operator_release == "v25.10.1"
    monkeypatch.setenv("GPUCANARY_OPERATOR_RELEASE", "26.7.0")
    with pytest.raises(ConfigError, match="not a release the fleet can run") as refused:
        FleetLayout.from_env()
    assert str(refused.value) == "GPUCANARY_OPERATOR_RELEASE='26.7.0' is not a release the fleet can run; use one of " \
        + ", ".join(OPERATOR_RELEASES)


def test_build_script_refuses_an_unknown_release_in_one_line(tmp_path: Path) -> None:
    result = build("v24.9.2", env={"GPUCANARY_CACHE": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "unknown GPU Operator release 'v24.9.2'; use one of: v26.7.0 v26.3.3 v25.10.1 v25.3.4"]
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_build_script_refuses_a_missing_archive_in_one_line(tmp_path: Path) -> None:
    result = build("v26.3.3", env={"GPUCANARY_CACHE": str(tmp_path / "cache"),
                                   "GPUCANARY_OPERATOR_ARCHIVE_DIR": str(tmp_path / "none")})
    assert result.returncode == 3
    assert result.stderr.splitlines() == [
        f"no source archive for GPU Operator v26.3.3 at {tmp_path / 'none' / 'gpu-operator-v26.3.3.tar.gz'}; "
        "set GPUCANARY_OPERATOR_ARCHIVE_DIR or GPUCANARY_OPERATOR_SOURCE=git"]
    assert not (tmp_path / "cache").exists()


def test_build_script_refuses_an_unknown_source(tmp_path: Path) -> None:
    result = build("v26.7.0", env={"GPUCANARY_CACHE": str(tmp_path), "GPUCANARY_OPERATOR_SOURCE": "svn"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["unknown GPUCANARY_OPERATOR_SOURCE 'svn'; use archive or git"]


def test_a_warm_cache_builds_nothing(tmp_path: Path) -> None:
    """A completed build for the archive's size and mtime is reused as it is (no tar, no go)."""
    archives = tmp_path / "third-party"
    archives.mkdir()
    (archives / "gpu-operator-v25.10.1.tar.gz").write_bytes(b"not unpacked on a cache hit")
    env = {"GPUCANARY_CACHE": str(tmp_path / "cache"), "GPUCANARY_OPERATOR_ARCHIVE_DIR": str(archives),
           "PATH": "/usr/bin:/bin"}
    cold = build("v25.10.1", env=env)          # would unpack and build: learn the cache directory it names
    assert cold.returncode != 0
    out = next((tmp_path / "cache" / "bin").glob("gpu-operator-v25.10.1-*.partial"))
    done = out.with_suffix("")
    out.rename(done)
    (done / ".complete").touch()
    tools, called = tmp_path / "tools", tmp_path / "called"
    tools.mkdir()
    for tool in ("tar", "go", "git"):       # what a build would run: each notes that it ran, and fails
        (tools / tool).write_text(f"#!/bin/sh\necho {tool} >> {called}\nexit 1\n")
        (tools / tool).chmod(0o755)
    warm = build("v25.10.1", env={**env, "PATH": f"{tools}:{env['PATH']}"})
    assert warm.returncode == 0, warm.stderr
    assert warm.stdout.strip() == str(done)
    assert warm.stderr.strip() == f"gpu-operator v25.10.1 up to date in {done}"
    assert not called.exists(), called.read_text()


def test_every_crd_of_the_chart_is_installed(tmp_path: Path) -> None:
    for name in ("nvidia.com_nvidiadrivers.yaml", "nvidia.com_clusterpolicies.yaml", "nvidia.com_gpuclusters.yaml"):
        (tmp_path / name).write_text("metadata: {name: x}\n")
    assert [p.name for p in crd_files(tmp_path)] == [
        "nvidia.com_clusterpolicies.yaml", "nvidia.com_gpuclusters.yaml", "nvidia.com_nvidiadrivers.yaml"]
    (tmp_path / "nvidia.com_clusterpolicies.yaml").unlink()
    with pytest.raises(Exception, match="no ClusterPolicy CRD"):
        crd_files(tmp_path)


def _policy(state: str, message: str | None = None) -> dict:
    conditions = [] if message is None else [
        {"type": "Ready", "status": "False", "reason": "OperandNotReady", "message": message},
        {"type": "Error", "status": "True", "reason": "OperandNotReady", "message": message}]
    return {"status": {"state": state, "conditions": conditions}}


def test_notready_only_for_an_nvidiadriver_upgrade_counts_as_ready() -> None:
    # message format: controllers/clusterpolicy_controller.go clusterPolicyNotReadyMessage (v26.7.0)
    upgrade_only = ("ClusterPolicy is not ready; NVIDIADriver upgrade has not completed; one or more "
                    "NVIDIADriver-owned Nodes are marked pending, in-progress, or failed")
    with_states = ("ClusterPolicy is not ready; states not ready: [state-device-plugin]; NVIDIADriver upgrade "
                   "has not completed")
    assert policy_ready(_policy("ready"))
    assert policy_ready(_policy("notReady", upgrade_only))
    assert not policy_ready(_policy("notReady", with_states))
    assert not policy_ready(_policy("notReady"))
    assert not policy_ready({})


def test_release_labels_are_the_charts_without_claiming_helm() -> None:
    labels = release_labels("v26.3.3")
    assert labels["app.kubernetes.io/version"] == "v26.3.3"
    assert labels["helm.sh/chart"] == "gpu-operator-v26.3.3"
    assert labels["app.kubernetes.io/managed-by"] == "gpucanary-fleet"


def test_without_the_build_scripts_the_newest_complete_cached_build_is_used(tmp_path, monkeypatch) -> None:
    from pytest_gpucanary.errors import EnvError
    from pytest_gpucanary.fleet import binaries

    monkeypatch.setattr(binaries, "CI_DIR", tmp_path / "no-checkout")          # an installed package: no ci/
    monkeypatch.setenv("GPUCANARY_CACHE", str(tmp_path / "cache"))
    for name in ("GPUCANARY_BIN_DIR", "GPUCANARY_OPERATOR_BIN_DIR"):
        monkeypatch.delenv(name, raising=False)
    said: list[str] = []
    with pytest.raises(EnvError, match="no etcd binaries found; set GPUCANARY_BIN_DIR"):
        binaries.find_bin_dir(binaries.CONTROL_PLANE, said.append)

    def build(name: str, files: tuple[str, ...], mtime: int) -> None:
        out = tmp_path / "cache" / "bin" / name
        out.mkdir(parents=True)
        for file in files:
            (out / file).write_text("")
        os.utime(out, (mtime, mtime))

    build("k8s-1.36.3-etcd-3.6.16-kwok-0.8.0-old", binaries.CONTROL_PLANE.required, 1_000)
    build("k8s-1.36.3-etcd-3.6.16-kwok-0.8.0-new", binaries.CONTROL_PLANE.required, 2_000)
    build("k8s-1.36.3-etcd-3.6.16-kwok-0.8.0-newest.partial", binaries.CONTROL_PLANE.required, 3_000)
    build("k8s-1.36.3-etcd-3.6.16-kwok-0.8.0-half", ("etcd",), 4_000)
    found = binaries.find_bin_dir(binaries.CONTROL_PLANE, said.append)
    assert found.name == "k8s-1.36.3-etcd-3.6.16-kwok-0.8.0-new" and said == [f"fleet: etcd from the build cache: {found}"]
    build("gpu-operator-v26.7.0-abc", binaries.GPU_OPERATOR.required, 1_000)
    build("gpu-operator-v25.10.1-def", binaries.GPU_OPERATOR.required, 2_000)
    assert binaries.find_bin_dir(binaries.GPU_OPERATOR, said.append, "v26.7.0").name == "gpu-operator-v26.7.0-abc"
