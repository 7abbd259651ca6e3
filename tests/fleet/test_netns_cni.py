"""ci/node/netns-cni, the kubelet node's pod network: built from source here and run as the runtime runs a CNI plugin,
on a network namespace of its own. With `apiServer` in its config (GPUCluster mode) a pod reaches the apiserver at the
kubernetes Service's address: the forwarder listens inside the pod's namespace and dials 127.0.0.1; the machine's
addresses and routes do not change, and DEL stops the forwarder."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import go_built


SERVICE = "10.96.0.1:443"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return go_built("node/netns-cni", tmp_path_factory.mktemp("cni") / "gpucanary-netns")


@pytest.fixture
def pod_netns() -> Iterator[str]:
    """A network namespace held by a sleeping process, as a pod sandbox's is."""
    holder = subprocess.Popen(["unshare", "--net", "sleep", "300"])
    path = f"/proc/{holder.pid}/ns/net"
    deadline = time.monotonic() + 5
    while os.readlink(path) == os.readlink("/proc/self/ns/net") and time.monotonic() < deadline:
        time.sleep(0.02)
    yield path
    holder.kill()
    holder.wait()


@pytest.fixture
def upstream() -> Iterator[int]:
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"the apiserver\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _cni(plugin: Path, command: str, netns: str, config: dict) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": command, "CNI_CONTAINERID": "c1", "CNI_NETNS": netns,
           "CNI_IFNAME": "eth0", "CNI_PATH": str(plugin.parent)}
    return subprocess.run([str(plugin)], input=json.dumps(config), env=env, capture_output=True, text=True, timeout=30)


def _machine_network() -> tuple[str, str]:
    return (subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout,
            subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout)


def test_a_pod_reaches_the_apiserver_at_the_services_address_and_nothing_else_changes(
        plugin: Path, pod_netns: str, upstream: int, tmp_path: Path) -> None:
    config = {"cniVersion": "1.0.0", "name": "gpucanary-netns", "type": "gpucanary-netns", "subnet": "10.245.7.0/24",
              "dataDir": str(tmp_path / "ipam"), "apiServer": {"service": SERVICE, "upstream": f"127.0.0.1:{upstream}"}}
    before = _machine_network()

    added = _cni(plugin, "ADD", pod_netns, config)
    try:
        _reaches_the_apiserver(plugin, pod_netns, config, added, before, tmp_path)
    finally:
        _cni(plugin, "DEL", pod_netns, config)  # again, harmless: nothing of the test's outlives it


def _reaches_the_apiserver(plugin: Path, pod_netns: str, config: dict, added: subprocess.CompletedProcess[str],
                           before: tuple[str, str], tmp_path: Path) -> None:
    assert added.returncode == 0, added.stdout + added.stderr
    assert json.loads(added.stdout)["ips"] == [{"address": "10.245.7.2/32", "interface": 0}]
    fetch = ("import urllib.request; print(urllib.request.urlopen('http://" + SERVICE + "/', timeout=5).read().decode())")
    for _ in range(50):  # the forwarder listens a moment after ADD returns
        inside = subprocess.run(["nsenter", f"--net={pod_netns}", "python3", "-c", fetch],
                                capture_output=True, text=True, timeout=30)
        if inside.returncode == 0:
            break
        time.sleep(0.1)
    assert inside.stdout == "the apiserver\n\n", inside.stderr[-500:]   # the answer, then print's newline
    assert _machine_network() == before                              # the machine's addresses and routes as they were
    host, port = SERVICE.split(":")
    listening = subprocess.run(["ss", "-Hltn", f"src {host}:{port}"], capture_output=True, text=True).stdout
    assert listening.strip() == ""                                   # the listener is the pod's, not the machine's
    [pid_file] = (tmp_path / "ipam" / "gpucanary-netns").glob("forwarder-*.pid")
    pid = int(pid_file.read_text())
    assert Path(f"/proc/{pid}").exists()

    deleted = _cni(plugin, "DEL", pod_netns, config)

    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the forwarder {pid} outlived DEL")
    assert not list((tmp_path / "ipam" / "gpucanary-netns").iterdir())   # its address and pid file released


def test_without_api_server_a_pod_reaches_nothing(plugin: Path, pod_netns: str, tmp_path: Path) -> None:
    config = {"cniVersion": "1.0.0", "name": "gpucanary-netns", "type": "gpucanary-netns", "subnet": "10.245.7.0/24",
              "dataDir": str(tmp_path / "ipam")}
    assert _cni(plugin, "ADD", pod_netns, config).returncode == 0
    addresses = subprocess.run(["nsenter", f"--net={pod_netns}", "ip", "-o", "addr"], capture_output=True, text=True,
                               check=True).stdout
    assert "10.96.0.1" not in addresses and "10.245.7.2/32" in addresses
    dial = "import socket; socket.create_connection(('10.96.0.1', 443), timeout=2)"
    inside = subprocess.run(["nsenter", f"--net={pod_netns}", "python3", "-c", dial], capture_output=True, text=True)
    assert inside.returncode != 0 and "unreachable" in inside.stderr, inside.stderr[-300:]   # no route out of the pod
    assert not list((tmp_path / "ipam" / "gpucanary-netns").glob("forwarder-*"))
