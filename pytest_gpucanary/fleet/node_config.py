"""The config files a kubelet node's processes read, written into its node directory by
`KubeletNode.prepare`: the CNI conflist, containerd's config.toml (its sockets and state inside the node's
namespace, RuntimeClass `nvidia` behind the runtime stand-in), the KubeletConfiguration, and the node's client
certificate for system:node:<name>, signed by the fleet CA, with its kubeconfig.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Protocol

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet.images import PAUSE_IMAGE
from pytest_gpucanary.fleet.layout import HOST, FleetLayout
from pytest_gpucanary.fleet.pki import KUBERNETES_SERVICE_IP


class KubeletNode(Protocol):
    """The node as its config files read it (`kubelet_node.KubeletNode`)."""

    @property
    def layout(self) -> FleetLayout: ...

    @property
    def index(self) -> int: ...

    @property
    def bin_dir(self) -> Path: ...

    @property
    def name(self) -> str: ...

    @property
    def dir(self) -> Path: ...

    @property
    def cgroup_root(self) -> str: ...

    @property
    def containerd_socket(self) -> Path: ...

    def port(self, name: str) -> int: ...

    def taints(self) -> list[dict[str, str]]: ...


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise EnvError(f"openssl {args[0]} failed for the kubelet node: {result.stderr.strip()[-200:]}")


def cni_config(node: KubeletNode) -> dict:
    """In GPUCluster mode the pods reach the apiserver as the kubernetes Service (ci/node/netns-cni): NVIDIA's DRA
    kubelet plugin and the validator in its init container use in-cluster config, and the operator gives that
    DaemonSet no host network."""
    api = (
        {
            "apiServer": {
                "service": f"{KUBERNETES_SERVICE_IP}:443",
                "upstream": f"{HOST}:{node.layout.port('kube-apiserver')}",
            }
        }
        if node.layout.dra
        else {}
    )
    return {
        "cniVersion": "1.0.0",
        "name": "gpucanary-netns",
        "plugins": [
            {
                "type": "gpucanary-netns",
                "subnet": f"10.245.{node.index}.0/24",
                "dataDir": str(node.dir / "cni" / "ipam"),
                **api,
            }
        ],
    }


def containerd_config(node: KubeletNode) -> str:
    d, cri = node.dir / "containerd", '[plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{d / "root"}"
state = "{d / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{node.containerd_socket}"
[ttrpc]
  address = ""
[debug]
  address = ""
[metrics]
  address = "{HOST}:{node.port("containerd-metrics")}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / "opt"}"
{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "{HOST}"
  stream_server_port = "{node.port("containerd-stream")}"
  enable_selinux = false
  restrict_oom_score_adj = true  # root here lacks CAP_SYS_RESOURCE; negative scores would fail every sandbox
{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  privileged_without_host_devices = true  # a privileged pod gets no device of the machine
{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
# RuntimeClass "nvidia" (the operator's operands ask for it): runc behind the stand-in for
# nvidia-container-runtime (ci/node/nvidia-runtime), which mounts the driver root's NVML and nvidia-smi
# into a container that asks for GPUs, as the NVIDIA Container Toolkit does
{cri}.containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  privileged_without_host_devices = true
{cri}.containerd.runtimes.nvidia.options]
  SystemdCgroup = false
  BinaryName = "{node.bin_dir / "nvidia-container-runtime"}"
{cri}.cni]
  bin_dir = "{node.dir / "cni" / "bin"}"
  conf_dir = "{node.dir / "cni" / "net.d"}"
"""


def kubelet_config(node: KubeletNode) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this machine is cgroup v1 (hybrid); 1.36 refuses it unless told
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{node.cgroup_root}",
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "failSwapOn": False,
        "address": HOST,
        "port": node.port("kubelet"),
        "readOnlyPort": 0,
        "healthzBindAddress": HOST,
        "healthzPort": node.port("kubelet-healthz"),
        # the fleet's apiserver calls kubelets without a client certificate (logs, exec); the
        # kubelet listens on 127.0.0.1 only
        "authentication": {
            "anonymous": {"enabled": True},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(node.layout.pki / "ca.crt")},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "imageServiceEndpoint": f"unix://{node.containerd_socket}",
        "podLogsDir": str(node.dir / "kubelet" / "pod-logs"),
        "registerNode": True,
        "registerWithTaints": node.taints(),
        "maxPods": 30,
        "serializeImagePulls": False,
        "resolvConf": "",
        "makeIPTablesUtilChains": False,  # the machine's iptables are not the node's to change
        "imageGCHighThresholdPercent": 100,  # the imported images cannot be pulled again
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "nodeStatusUpdateFrequency": "10s",
    }


def credentials(node: KubeletNode) -> None:
    """A client certificate for system:node:<name> signed by the fleet CA, and its kubeconfig."""
    pki, ca = node.dir / "pki", node.layout.pki
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
        "-subj",
        f"/O=system:nodes/CN=system:node:{node.name}",
        cwd=pki,
    )
    (pki / "node.ext").write_text("extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        str(ca / "ca.crt"),
        "-CAkey",
        str(ca / "ca.key"),
        "-CAcreateserial",
        "-CAserial",
        "ca.srl",
        "-days",
        "30",
        "-out",
        "node.crt",
        "-extfile",
        "node.ext",
        cwd=pki,
    )
    (node.dir / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: fleet\n  cluster:\n    server: {node.layout.apiserver_url}\n"
        f"    certificate-authority: {ca / 'ca.crt'}\n"
        f"users:\n- name: {node.name}\n  user:\n    client-certificate: {pki / 'node.crt'}\n"
        f"    client-key: {pki / 'node.key'}\n"
        f"contexts:\n- name: fleet\n  context:\n    cluster: fleet\n    user: {node.name}\n"
        "current-context: fleet\n"
    )
