"""ci/node/nvidia-runtime, the kubelet node's stand-in for nvidia-container-runtime: built from source here, run
in front of a runc that records what it was given. A container that asks for GPUs gets the driver root's NVML and
nvidia-smi and the NVML state's directory; one that asks for none (or void) and every other runc call pass through
unchanged; with no driver in the root the create fails as nvidia-container-cli's does."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness import go_built


NVML_DEST = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
RECORDING_RUNC = """#!/bin/sh
printf '%s\\n' "$@" > "$RECORD"
"""


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return go_built("node/nvidia-runtime", tmp_path_factory.mktemp("runtime") / "nvidia-container-runtime")


def _node(tmp_path: Path, *, driver: bool) -> dict[str, str]:
    """A node's /run/nvidia (with a loaded driver's root or none), and a runc on PATH that records its args."""
    run = tmp_path / "run-nvidia"
    (run / "driver" / "usr" / "lib64").mkdir(parents=True)
    (run / "driver" / "usr" / "bin").mkdir(parents=True)
    if driver:
        (run / "driver" / "usr" / "lib64" / "libnvidia-ml.so.1").write_text("shim")
        (run / "driver" / "usr" / "bin" / "nvidia-smi").write_text("smi")
        (run / "gpucanary-nvml.env").write_text("DRIVER_VERSION=580.82.07\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "runc").write_text(RECORDING_RUNC)
    (bin_dir / "runc").chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "GPUCANARY_NVIDIA_RUN": str(run), "RECORD": str(tmp_path / "argv")}


def _bundle(tmp_path: Path, env: list[str]) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    spec = {"ociVersion": "1.2.0", "process": {"args": ["gpu-feature-discovery"], "env": ["PATH=/bin", *env]},
            "root": {"path": "rootfs"}, "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"namespaces": [{"type": "mount"}]}}
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def _create(runtime: Path, env: dict[str, str], bundle: Path) -> subprocess.CompletedProcess[str]:
    args = ["--root", "/run/containerd/runc/k8s.io", "--log", "log.json", "--log-format", "json",
            "create", "--bundle", str(bundle), "--pid-file", "init.pid", "ctr-1"]
    return subprocess.run([str(runtime), *args], env=env, capture_output=True, text=True, timeout=30)


def test_a_container_that_asks_for_gpus_gets_the_drivers_nvml_nvidia_smi_and_state(runtime: Path, tmp_path: Path) -> None:
    env = _node(tmp_path, driver=True)
    bundle = _bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])
    result = _create(runtime, env, bundle)
    assert result.returncode == 0, result.stderr
    spec = json.loads((bundle / "config.json").read_text())
    run = env["GPUCANARY_NVIDIA_RUN"]
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert mounts[NVML_DEST]["source"] == f"{run}/driver/usr/lib64/libnvidia-ml.so.1"
    assert mounts["/usr/bin/nvidia-smi"]["source"] == f"{run}/driver/usr/bin/nvidia-smi"
    assert mounts["/run/gpucanary-nvml"]["source"] == run     # the directory: a driver swap renames a new state in
    assert all("ro" in mounts[d]["options"] for d in (NVML_DEST, "/usr/bin/nvidia-smi", "/run/gpucanary-nvml"))
    assert "GPUCANARY_NVML_STATE=/run/gpucanary-nvml/gpucanary-nvml.env" in spec["process"]["env"]
    assert spec["linux"] == {"namespaces": [{"type": "mount"}]}      # the rest of the spec as it was
    assert Path(env["RECORD"]).read_text().split("\n")[6:9] == ["create", "--bundle", str(bundle)]   # then runc


def test_a_state_path_the_container_sets_itself_is_kept(runtime: Path, tmp_path: Path) -> None:
    env = _node(tmp_path, driver=True)
    bundle = _bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all", "GPUCANARY_NVML_STATE=/host/run/nvidia/gpucanary-nvml.env"])
    assert _create(runtime, env, bundle).returncode == 0
    state = [e for e in json.loads((bundle / "config.json").read_text())["process"]["env"]
             if e.startswith("GPUCANARY_NVML_STATE=")]
    assert state == ["GPUCANARY_NVML_STATE=/host/run/nvidia/gpucanary-nvml.env"]


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="]])
def test_a_container_that_asks_for_no_gpu_passes_through_unchanged(runtime: Path, tmp_path: Path, env: list[str]) -> None:
    node = _node(tmp_path, driver=False)          # no driver: a driver container (void) must still start
    bundle = _bundle(tmp_path, env)
    before = (bundle / "config.json").read_text()
    result = _create(runtime, node, bundle)
    assert result.returncode == 0, result.stderr
    assert (bundle / "config.json").read_text() == before
    assert "create" in Path(node["RECORD"]).read_text().split("\n")


def test_with_no_driver_loaded_the_create_fails_as_nvidia_container_cli_does(runtime: Path, tmp_path: Path) -> None:
    env = _node(tmp_path, driver=False)
    bundle = _bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])
    result = _create(runtime, env, bundle)
    assert result.returncode == 1
    assert result.stderr.strip() == "nvidia-container-cli: initialization error: nvml error: driver not loaded"
    assert not Path(env["RECORD"]).exists()                          # runc never ran


def test_every_other_runc_call_goes_straight_to_runc(runtime: Path, tmp_path: Path) -> None:
    env = _node(tmp_path, driver=False)
    result = subprocess.run([str(runtime), "--root", "/run/r", "state", "ctr-1"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert Path(env["RECORD"]).read_text().split("\n")[:4] == ["--root", "/run/r", "state", "ctr-1"]
