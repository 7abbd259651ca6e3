"""What the fleet writes for a kubelet node, without starting one: ports, labels, configs, image tars."""

from __future__ import annotations

import hashlib
import io
import shutil
import json
import re
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.fleet.images import ImageSpec, operator_plugin_images, shared_libraries, write_oci_tar
from pytest_gpucanary.fleet.kubelet_node import (KERNEL_TUNABLES, TAINT_KEY, KubeletNode,
                                                 driver_images, gpu_labels, hosts_text, operator_images)
from pytest_gpucanary.fleet.manifests import host_network_service
from pytest_gpucanary.fleet.node_config import containerd_config, kubelet_config
from pytest_gpucanary.fleet.operator import apply_policies
from pytest_gpucanary.fleet.pki import ensure_pki
from pytest_gpucanary.fleet.layout import (KUBELET_NODE_PORTS, KUBELET_WORKLOAD_OFFSETS, MAX_KUBELET_NODES,
                                           PORT_OFFSETS, FleetLayout)


def test_kubelet_node_ports_stay_in_the_fleet_range_and_clash_with_nothing(tmp_path: Path) -> None:
    layout = FleetLayout(root=tmp_path, port_base=26800)
    node_ports = [layout.kubelet_node_port(i, name) for i in range(MAX_KUBELET_NODES) for name in KUBELET_NODE_PORTS]
    fixed = ([layout.port(name) for name in PORT_OFFSETS] + list(layout.kubelet_workload_ports)
             + [layout.kubelet_service_port(i) for i in range(MAX_KUBELET_NODES)])
    everything = node_ports + fixed
    assert len(set(everything)) == len(everything)
    assert all(26800 <= port < 26900 for port in everything)
    assert len(KUBELET_WORKLOAD_OFFSETS) == len(layout.kubelet_workload_ports)


@pytest.mark.parametrize("value", ["-1", str(MAX_KUBELET_NODES + 1), "two"])
def test_bad_kubelet_node_count_is_a_config_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GPUCANARY_FLEET_KUBELET_NODES", value)
    with pytest.raises(ConfigError, match="GPUCANARY_FLEET_KUBELET_NODES"):
        FleetLayout.from_env()


@pytest.mark.parametrize(("env", "pool"), [
    ({}, True),                                                   # the fleet's default pool
    ({"GPUCANARY_FLEET_KUBELET_POOL": "0"}, False),               # the KWOK pools instead
    ({"GPUCANARY_FLEET_KUBELET_NODES": "0"}, False),
    ({"GPUCANARY_FLEET_DRIVER_MODE": "clusterpolicy"}, False),   # opt in: the one DaemonSet takes the pool's settings
    ({"GPUCANARY_FLEET_DRIVER_MODE": "clusterpolicy", "GPUCANARY_FLEET_KUBELET_POOL": "1"}, True),
])
def test_the_kubelet_node_is_a_canary_pool_wherever_it_can_be(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                                 pool: bool) -> None:
    for name in ("GPUCANARY_FLEET_KUBELET_POOL", "GPUCANARY_FLEET_KUBELET_NODES", "GPUCANARY_FLEET_DRIVER_MODE",
                 "GPUCANARY_OPERATOR_RELEASE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert FleetLayout.from_env().kubelet_pool is pool


@pytest.mark.parametrize("release", ["v25.10.1", "v25.3.4"])
def test_a_kubelet_pool_needs_a_release_with_the_drivers_host_network(monkeypatch: pytest.MonkeyPatch,
                                                                      release: str) -> None:
    for name in ("GPUCANARY_FLEET_KUBELET_POOL", "GPUCANARY_FLEET_KUBELET_NODES", "GPUCANARY_FLEET_DRIVER_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUCANARY_OPERATOR_RELEASE", release)
    assert not FleetLayout.from_env().kubelet_pool                  # not the default there
    for mode in ("nvidiadriver", "clusterpolicy"):
        monkeypatch.setenv("GPUCANARY_FLEET_KUBELET_POOL", "1")
        monkeypatch.setenv("GPUCANARY_FLEET_DRIVER_MODE", mode)
        with pytest.raises(ConfigError, match=f"hostNetwork setting, which GPU Operator {release} does not have"):
            FleetLayout.from_env()


@pytest.mark.parametrize("mode", ["nvidiadriver", "clusterpolicy"])
def test_the_driver_of_a_kubelet_pool_node_runs_on_the_host_network_in_either_mode(mode: str) -> None:
    applied: list[dict] = []
    apply_policies(lambda *args, stdin: applied.append(json.loads(stdin)), driver_mode=mode, release="v26.7.0",
                   pool_nodes=("gpu-kubelet-0",), apiserver_url="https://127.0.0.1:28201")
    drivers = {d["metadata"]["name"]: d["spec"].get("driver", d["spec"]) for d in applied}
    # NVIDIA's validator runs there as on its own GPU-less test stack, and reaches the apiserver on loopback
    validator, plugin = applied[0]["spec"]["validator"], applied[0]["spec"]["devicePlugin"]
    assert {e["name"]: e["value"] for e in plugin["env"]} == {"DP_DISABLE_HEALTHCHECKS": "all",
                                                               "GPUCANARY_NVML_STATE": "/host/run/nvidia/gpucanary-nvml.env"}
    assert validator["hostNetwork"] is True and validator["image"] == "gpu-operator-validator"
    env = {check: {e["name"]: e["value"] for e in validator[check]["env"]} for check in ("driver", "cuda", "plugin")}
    assert env["driver"]["DISABLE_DEV_CHAR_SYMLINK_CREATION"] == "true" and env["cuda"]["WITH_WORKLOAD"] == "false"
    assert all((e["KUBERNETES_SERVICE_HOST"], e["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "28201") for e in env.values())
    pool_driver = drivers["gpu-kubelet-0" if mode == "nvidiadriver" else "cluster-policy"]
    assert pool_driver["hostNetwork"] is True and pool_driver["startupProbe"]["initialDelaySeconds"] == 5
    if mode == "nvidiadriver":      # the KWOK nodes' driver is left as the operator renders it
        assert "hostNetwork" not in drivers["fleet"] and "hostNetwork" not in drivers["cluster-policy"]
    else:
        assert set(drivers) == {"cluster-policy"} and pool_driver["useNvidiaDriverCRD"] is False
    kwok_only: list[dict] = []
    apply_policies(lambda *args, stdin: kwok_only.append(json.loads(stdin)), driver_mode=mode, release="v26.7.0")
    assert set(kwok_only[0]["spec"]["validator"]) == {"repository", "image", "version"}
    assert "env" not in kwok_only[0]["spec"]["devicePlugin"] and "cdi" not in kwok_only[0]["spec"]
    assert applied[0]["spec"]["cdi"] == {"enabled": False}


def test_gpu_labels_are_the_kwok_gpu_nodes_nfd_and_gfd_labels_without_kwoks_own() -> None:
    labels = gpu_labels()
    assert labels["feature.node.kubernetes.io/pci-10de.present"] == "true"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert "type" not in labels and "gpucanary.io/driver-pool" not in labels  # kwok's, and the fleet driver's
    assert "nvidia.com/gpu.deploy.gpu-feature-discovery" not in labels        # keeps GFD pods off KWOK nodes only
    assert {k for k in gpu_labels(gfd=False) if k.startswith("nvidia.com/")} == set()   # a pool node's GFD writes them


def test_hosts_names_every_kubelet_node_on_loopback(tmp_path: Path) -> None:
    text = hosts_text(FleetLayout(root=tmp_path, kubelet_nodes=2))
    assert text.splitlines()[-1] == "127.0.0.1 gpu-kubelet-0 gpu-kubelet-1"


GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _node(tmp_path: Path, *, pool: bool = False) -> KubeletNode:
    return KubeletNode(FleetLayout(root=tmp_path, port_base=26800, kubelet_pool=pool), 0, tmp_path / "bin")


def test_configs_bind_loopback_and_keep_the_machine_as_it_is(tmp_path: Path) -> None:
    node = _node(tmp_path)
    containerd = tomllib.loads(containerd_config(node))
    cri = containerd["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["stream_server_address"] == "127.0.0.1" and cri["stream_server_port"] == "26803"
    assert containerd["metrics"]["address"] == "127.0.0.1:26802"
    assert set(cri["containerd"]["runtimes"]) == {"runc", "nvidia"}
    kubelet = kubelet_config(node)
    assert (kubelet["address"], kubelet["port"], kubelet["healthzBindAddress"]) == ("127.0.0.1", 26800, "127.0.0.1")
    assert kubelet["readOnlyPort"] == 0 and kubelet["makeIPTablesUtilChains"] is False
    assert kubelet["cgroupRoot"] == "/gpucanary-26800-gpu-kubelet-0"
    assert kubelet["registerWithTaints"] == [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
    assert set(KERNEL_TUNABLES) == {"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops"}


def test_process_plugin_keeps_operands_off(tmp_path: Path) -> None:
    process = _node(tmp_path)
    assert process.labels()["nvidia.com/gpu.deploy.operands"] == "false"
    assert [c.name for c in process.components()][-1] == "gpu-kubelet-0-device-plugin"


def test_a_node_that_is_no_pool_runs_nvidias_plugin_over_the_nvml_of_a_host_installed_driver(tmp_path: Path) -> None:
    node = _node(tmp_path)
    (tmp_path / "bin").mkdir()
    plugin, shim = tmp_path / "bin" / "nvidia-device-plugin", tmp_path / "bin" / "libnvidia-ml.so.1"
    plugin.write_text("plugin")
    shim.write_text("shim")
    ensure_pki(node.layout.pki)                                  # the fleet's CA signs the node's certificate
    node.prepare(hosts_text(node.layout), device_plugin=plugin, nvml_shim=shim)
    *_, component = node.components()
    assert Path(component.argv[4]).resolve() == plugin.resolve()
    root = node.dir / "driver-root"
    assert f"--driver-root={root}" in component.argv and (root / "usr" / "lib64" / "libnvidia-ml.so.1").read_text() == "shim"
    env = dict(component.env)
    state = Path(env["GPUCANARY_NVML_STATE"]).read_text().splitlines()
    assert "DRIVER_VERSION=580.82.07" in state and env["DP_DISABLE_HEALTHCHECKS"] == "all"
    devices = [line.split() for line in state if line.startswith("DEVICE=")]
    assert len(devices) == 8 and all(GPU_UUID.match(d[0].removeprefix("DEVICE=")) for d in devices), devices
    assert (component.port, component.health_url) == (0, "")     # it listens on no port of the machine


def test_operator_image_names_follow_the_fleet_clusterpolicy() -> None:
    names = operator_images()
    assert names["devicePlugin"].startswith("nvcr.io/nvidia/k8s-device-plugin:")
    assert names["validator"].startswith("nvcr.io/nvidia/cloud-native/gpu-operator-validator:")


def test_oci_tar_names_each_image_and_its_blobs_match_their_digests(tmp_path: Path) -> None:
    binary = tmp_path / "tool"
    binary.write_bytes(b"\x7fELF not really")
    spec = ImageSpec(("localhost/a/b:1", "docker.io/library/b:2"), ("/tool",), (("/tool", binary),),
                     (("/bin/x", "tool"),), (("/bin/bash", b"#!/bin/sh\n"),))
    write_oci_tar(spec, tmp_path / "image.tar")
    with tarfile.open(tmp_path / "image.tar") as tar:
        blobs = {m.name.rsplit("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.name.startswith("blobs/")}
        index = json.loads(tar.extractfile("index.json").read())
    assert all(hashlib.sha256(data).hexdigest() == digest for digest, data in blobs.items())
    names = [m["annotations"]["io.containerd.image.name"] for m in index["manifests"]]
    assert names == ["localhost/a/b:1", "docker.io/library/b:2"]
    manifest = json.loads(blobs[index["manifests"][0]["digest"][7:]])
    config = json.loads(blobs[manifest["config"]["digest"][7:]])
    assert config["config"]["Entrypoint"] == ["/tool"]
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]
    layer = blobs[manifest["layers"][0]["digest"][7:]]
    with tarfile.open(fileobj=io.BytesIO(layer)) as inner:
        assert {"tool", "bin/x", "bin/bash", "etc/passwd", "tmp"} <= set(inner.getnames())


def test_the_device_plugin_image_carries_plugin_gfd_and_the_c_library_they_link_and_asks_for_gpus(tmp_path: Path) -> None:
    binary = Path(shutil.which("ls") or "/bin/ls")        # any dynamically linked program of the machine
    for name in ("nvidia-device-plugin", "gpu-feature-discovery"):
        shutil.copy(binary, tmp_path / name)
    [spec] = operator_plugin_images(device_plugin="nvcr.io/nvidia/k8s-device-plugin:v0.17.4", plugin_dir=tmp_path)
    write_oci_tar(spec, tmp_path / "plugin.tar")
    with tarfile.open(tmp_path / "plugin.tar") as tar:
        blobs = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.startswith("blobs/")}
    layer = max(blobs.values(), key=len)
    with tarfile.open(fileobj=io.BytesIO(layer)) as layer_tar:
        names = set(layer_tar.getnames())
    loader = next(inside for inside, _ in shared_libraries(binary) if "ld-linux" in inside)
    assert {"bin/nvidia-device-plugin", "bin/gpu-feature-discovery", "bin/lsmod", "bin/sh",
            loader.lstrip("/")} <= names, sorted(names)[:20]
    assert any(name.endswith("/libc.so.6") for name in names)
    config = next(json.loads(b) for b in blobs.values() if b.startswith(b"{") and b'"rootfs"' in b)
    assert "NVIDIA_VISIBLE_DEVICES=all" in config["config"]["Env"]   # as NVIDIA's CUDA-based image: the runtime mounts NVML


def test_kubelet_config_is_yaml_the_kubelet_reads(tmp_path: Path) -> None:
    text = yaml.safe_dump(kubelet_config(_node(tmp_path)), sort_keys=False)
    assert yaml.safe_load(text)["failCgroupV1"] is False


def test_a_pool_node_runs_driver_validator_device_plugin_and_gfd_untainted_with_a_driver_of_its_own(tmp_path: Path) -> None:
    node = _node(tmp_path, pool=True)
    deploy = {k: v for k, v in node.labels().items() if k.startswith("nvidia.com/gpu.deploy.")}
    assert sorted(k for k, v in deploy.items() if v == "true") == [
        "nvidia.com/gpu.deploy.device-plugin", "nvidia.com/gpu.deploy.driver",
        "nvidia.com/gpu.deploy.gpu-feature-discovery", "nvidia.com/gpu.deploy.operator-validator"]
    assert node.labels()["gpucanary.io/driver-pool"] == "gpu-kubelet-0"
    assert kubelet_config(node)["registerWithTaints"] == []     # the canary's service must be able to land there
    assert [c.name for c in node.components()] == ["gpu-kubelet-0-containerd", "gpu-kubelet-0-kubelet"]


def test_driver_images_carry_the_os_suffix_the_operator_appends() -> None:
    names = driver_images()
    assert names[0] == "nvcr.io/nvidia/driver:580.82.07-ubuntu22.04"       # the fleet's own version first
    assert "nvcr.io/nvidia/driver:580.95.05-ubuntu22.04" in names
    assert operator_images()["driverManager"] == "nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.8.1"


def test_host_network_service_serves_on_loopback_at_the_given_port() -> None:
    docs = list(yaml.safe_load_all(host_network_service(26840)))
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert spec["hostNetwork"] is True and container["args"] == ["netexec", "--http-port=26840"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", "host": "127.0.0.1"}
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PodDisruptionBudget"}


def test_gpucluster_mode_needs_v26_7_nvidiadriver_mode_and_pool_kubelet_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPUCANARY_FLEET_KUBELET_POOL", "GPUCANARY_FLEET_DRIVER_MODE", "GPUCANARY_OPERATOR_RELEASE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUCANARY_FLEET_DRA", "1")
    monkeypatch.setenv("GPUCANARY_FLEET_KUBELET_NODES", "0")
    assert FleetLayout.from_env().dra
    monkeypatch.setenv("GPUCANARY_FLEET_KUBELET_NODES", "1")
    layout = FleetLayout.from_env()
    assert layout.dra and layout.kubelet_pool                        # a kubelet node is a pool, by default
    for env, refusal in (
        ({"GPUCANARY_FLEET_KUBELET_POOL": "0"}, "in GPUCluster mode .* the kubelet nodes are canary pools"),
        ({"GPUCANARY_FLEET_DRIVER_MODE": "clusterpolicy"}, "takes its drivers from NVIDIADriver CRs"),
        ({"GPUCANARY_OPERATOR_RELEASE": "v26.3.3"}, r"GPU Operator v26.3.3 has no GPUCluster"),
    ):
        with monkeypatch.context() as scoped:
            for name, value in env.items():
                scoped.setenv(name, value)
            with pytest.raises(ConfigError, match=refusal):
                FleetLayout.from_env()


def test_gpucluster_mode_applies_a_gpucluster_where_the_clusterpolicy_would_be() -> None:
    applied: list[dict] = []
    apply_policies(lambda *args, stdin: applied.append(json.loads(stdin)), driver_mode="nvidiadriver",
                   release="v26.7.0", default_driver=True, gpu_cluster=True)
    assert [(d["kind"], d["metadata"]["name"]) for d in applied] == [("GPUCluster", "gpu-cluster"),
                                                                      ("NVIDIADriver", "fleet")]
    cluster = applied[0]
    assert cluster["metadata"]["labels"]["app.kubernetes.io/version"] == "v26.7.0"       # the release, as the chart
    assert cluster["spec"]["draDriver"]["version"] == "v0.5.0" and not cluster["spec"]["draDriver"]["computeDomains"]["enabled"]
