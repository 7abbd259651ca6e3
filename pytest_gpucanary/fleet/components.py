"""The fleet's processes: command lines and health endpoints, all on 127.0.0.1."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.fleet.layout import HOST, FleetLayout

OPERATOR_NAMESPACE = "gpu-operator"
VALIDATOR_IMAGE = "nvcr.io/nvidia/gpu-operator"  # the chart's validator.repository/validator.image


@dataclass(frozen=True)
class Component:
    name: str
    argv: tuple[str, ...]
    health_url: str  # "": healthy while it runs
    port: int  # 0: it listens on none
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class NodeLease:
    duration_s: int  # kwok renews each node's Lease about every quarter of this
    grace_s: int  # node-lifecycle marks a node NotReady after this without a renewal


def node_lease(gpu_nodes: int) -> NodeLease:
    """40 s / 60 s up to 64 nodes. Beyond, kwok's renewals (1,000 nodes: 100 updates/s at 40 s) fall
    behind on two busy cores and node-lifecycle taints hundreds of healthy nodes NotReady, so the
    lease and the grace period grow: 1,000 nodes renew 1,000 / 30 s = 33 updates/s."""
    if gpu_nodes <= 64:
        return NodeLease(40, 60)
    return NodeLease(120, 240)


def control_plane(layout: FleetLayout, bin_dir: Path) -> list[Component]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok, in start order."""
    pki, kubeconfig = layout.pki, str(layout.kubeconfig)
    etcd, peer = layout.port("etcd"), layout.port("etcd-peer")
    api, kcm = layout.port("kube-apiserver"), layout.port("kube-controller-manager")
    sched, kwok = layout.port("kube-scheduler"), layout.port("kwok")
    allow_paths = "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics"
    lease = node_lease(layout.gpu_nodes)
    return [
        Component(
            "etcd",
            (
                str(bin_dir / "etcd"),
                "--name=fleet",
                f"--data-dir={layout.data / 'etcd'}",
                f"--listen-client-urls=http://{HOST}:{etcd}",
                f"--advertise-client-urls=http://{HOST}:{etcd}",
                f"--listen-peer-urls=http://{HOST}:{peer}",
                f"--initial-advertise-peer-urls=http://{HOST}:{peer}",
                f"--initial-cluster=fleet=http://{HOST}:{peer}",
                "--listen-metrics-urls=",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=8589934592",
                "--unsafe-no-fsync=true",  # a disposable test store; fsync only slows CI disks
            ),
            f"http://{HOST}:{etcd}/health",
            etcd,
        ),
        Component(
            "kube-apiserver",
            (
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://{HOST}:{etcd}",
                "--etcd-prefix=/registry",
                f"--bind-address={HOST}",
                f"--advertise-address={HOST}",
                f"--secure-port={api}",
                f"--tls-cert-file={pki / 'admin.crt'}",
                f"--tls-private-key-file={pki / 'admin.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-key-file={pki / 'admin.key'}",
                f"--service-account-signing-key-file={pki / 'admin.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/12",  # the kubernetes Service: pki.KUBERNETES_SERVICE_IP
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--authorization-mode=Node,RBAC",
                "--kubelet-preferred-address-types=Hostname",  # kwok nodes answer as localhost only
                *audit_flags(layout),
            ),
            f"https://{HOST}:{api}/readyz",
            api,
        ),
        Component(
            "kube-controller-manager",
            (
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                allow_paths,
                f"--bind-address={HOST}",
                f"--secure-port={kcm}",
                "--leader-elect=false",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-account-private-key-file={pki / 'admin.key'}",
                "--kube-api-qps=200",
                "--kube-api-burst=400",
                # kwok nodes renew a Lease; these keep node-lifecycle from tainting them during slow CI moments
                "--node-monitor-period=5s",
                f"--node-monitor-grace-period={lease.grace_s}s",
            ),
            f"https://{HOST}:{kcm}/healthz",
            kcm,
        ),
        Component(
            "kube-scheduler",
            (
                str(bin_dir / "kube-scheduler"),
                f"--kubeconfig={kubeconfig}",
                allow_paths,
                f"--bind-address={HOST}",
                f"--secure-port={sched}",
                "--leader-elect=false",
                "--kube-api-qps=200",
                "--kube-api-burst=400",
            ),
            f"https://{HOST}:{sched}/healthz",
            sched,
        ),
        Component(
            "kwok",
            (
                str(bin_dir / "kwok"),
                f"--kubeconfig={kubeconfig}",
                f"--config={layout.root / 'kwok.yaml'}",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--tls-cert-file={pki / 'admin.crt'}",
                f"--tls-private-key-file={pki / 'admin.key'}",
                f"--node-ip={_kwok_node_ip(layout)}",
                "--node-name=localhost",
                f"--node-port={kwok}",
                f"--server-address={HOST}:{kwok}",
                f"--node-lease-duration-seconds={lease.duration_s}",
                "--cidr=10.244.0.0/16",
            ),
            f"https://{HOST}:{kwok}/healthz",
            kwok,
        ),
    ]


def _kwok_node_ip(layout: FleetLayout) -> str:
    """None, but with a kubelet pool: the validator DaemonSet (and in ClusterPolicy mode the one driver
    DaemonSet) then runs on the host's network on KWOK nodes too, kwok gives such a pod its node's IP, and with
    none its pod-create Stage repeats."""
    return HOST if layout.kubelet_pool and layout.kubelet_nodes else ""


def audit_flags(layout: FleetLayout) -> tuple[str, ...]:
    """Every request at level Metadata (see manifests.audit_policy), written before the response.

    Blocking mode, because a proof from the log ("the canary wrote nothing else") must not lose
    events: batch mode drops them when its buffer fills, which a 1,000-node fleet's lease renewals
    can do. 20 files of 200 MB hold a few hours of a 1,000-node fleet (about 1 kB per request).
    """
    return (
        f"--audit-policy-file={layout.audit_policy}",
        f"--audit-log-path={layout.audit_log}",
        "--audit-log-mode=blocking",
        "--audit-log-format=json",
        "--audit-log-maxsize=200",
        "--audit-log-maxbackup=20",
        "--audit-log-maxage=7",
    )


def prometheus(layout: FleetLayout, binary: str) -> Component:
    port = layout.port("prometheus")
    return Component(
        "prometheus",
        (
            binary,
            f"--config.file={layout.root / 'prometheus.yml'}",
            f"--storage.tsdb.path={layout.data / 'prometheus'}",
            f"--web.listen-address={HOST}:{port}",
            "--storage.tsdb.retention.time=1d",
            "--web.enable-lifecycle",
        ),
        f"http://{HOST}:{port}/-/ready",
        port,
    )


# The operator reads its manifests from /opt/gpu-operator and the host OS from /host-etc/os-release,
# as it would inside its container image. A private mount namespace gives it those paths without
# touching the machine: the fleet's own copies are bind-mounted over /opt and /host-etc.
_OPERATOR_MOUNTS = """set -e
mount --bind "$OPT" /opt
mount --bind "$HOST_ETC" /host-etc
exec "$@"
"""


def gpu_operator(layout: FleetLayout, bin_dir: Path) -> Component:
    metrics, health = layout.port("gpu-operator-metrics"), layout.port("gpu-operator-health")
    script = f'OPT="{layout.root / "opt"}" HOST_ETC="{layout.root / "host-etc"}"\n' + _OPERATOR_MOUNTS
    return Component(
        "gpu-operator",
        (
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "gpu-operator",
            str(bin_dir / "gpu-operator"),
            f"--kubeconfig={layout.kubeconfig}",
            "--leader-elect=false",
            f"--metrics-bind-address={HOST}:{metrics}",
            f"--health-probe-bind-address={HOST}:{health}",
            "--zap-log-level=info",
        ),
        f"http://{HOST}:{health}/readyz",
        health,
        # as the chart sets it (templates/operator.yaml): the image of the GPUCluster's DRA validator
        env=(
            ("OPERATOR_NAMESPACE", OPERATOR_NAMESPACE),
            ("VALIDATOR_IMAGE", f"{VALIDATOR_IMAGE}:{layout.operator_release}"),
        ),
    )


def nfd_master(layout: FleetLayout, bin_dir: Path, node: str) -> Component:
    """NFD's nfd-master, as the GPU Operator's chart runs it beside GFD: it labels each node from its NodeFeature
    objects (GFD writes one per kubelet pool node), `nvidia.com` labels allowed as the chart's extraLabelNs does.
    Its one listener (metrics and healthz) would take the port on every address, so it is off (`-port=-1`): no
    port, and healthy while it runs. `node` stands for the node its pod would run on, which it reads once."""
    return Component(
        "nfd-master",
        (
            str(bin_dir / "nfd-master"),
            f"-kubeconfig={layout.kubeconfig}",
            "-config=",
            "-port=-1",
            '-options={"extraLabelNs":["nvidia.com"]}',
        ),
        "",
        0,
        env=(("NODE_NAME", node), ("KUBERNETES_NAMESPACE", OPERATOR_NAMESPACE)),
    )


def node_agent(layout: FleetLayout) -> Component:
    port = layout.port("node-agent")
    return Component(
        "node-agent",
        (
            sys.executable,
            "-m",
            "pytest_gpucanary.fleet.node_agent_process",
            f"--kubeconfig={layout.kubeconfig}",
            f"--namespace={OPERATOR_NAMESPACE}",
            f"--health-port={port}",
            *(["--dra"] if layout.dra else []),
        ),
        f"http://{HOST}:{port}/healthz",
        port,
    )
