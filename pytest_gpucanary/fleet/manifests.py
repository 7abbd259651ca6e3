"""Render what the fleet feeds its components: kwok's configuration, the nodes, Prometheus' config."""

from __future__ import annotations

from pathlib import Path

import yaml

from pytest_gpucanary.fleet.layout import HOST, FleetLayout
from pytest_gpucanary.gpu_operator import GPU_RESOURCE
from pytest_gpucanary.shipped import FIXTURES

FLEET_FIXTURES = FIXTURES / "fleet"

# kwok's own Stages (copied from its module by ci/build.sh), except pod-complete and pod-ready, which we replace.
KWOK_STAGES = (
    "stage/node/fast/node-initialize.yaml",
    "stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "stage/pod/general/pod-create.yaml",
    "stage/pod/general/pod-init-container-running.yaml",
    "stage/pod/general/pod-init-container-completed.yaml",
    "stage/pod/general/pod-delete.yaml",
)


def gpu_node_name(index: int) -> str:
    return f"gpu-node-{index}"


CPU_NODE_NAME = "cpu-node-0"


def kwok_config(bin_dir: Path, *, gpu_nodes: int) -> str:
    docs = [
        {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokConfiguration",
            "options": {
                "podPlayStageParallelism": 8,
                "nodePlayStageParallelism": 4,
                "nodeLeaseParallelism": 4 if gpu_nodes <= 64 else 16,  # see components.node_lease
                "podsOnNodeSyncParallelism": 4,
            },
        }
    ]
    text = yaml.safe_dump_all(docs)
    for stage in KWOK_STAGES:
        text += "---\n" + (bin_dir / "kwok-manifests" / stage).read_text()
    for own in (
        "stage-pod-ready.yaml",
        "stage-pod-ready-when-allowed.yaml",
        "stage-pod-complete.yaml",
        "stage-pod-terminate.yaml",
    ):
        text += "---\n" + (FLEET_FIXTURES / own).read_text()
    return text + "---\n" + yaml.safe_dump(dcgm_metric(), sort_keys=False)


def _label(key: str) -> str:
    """CEL: a node label, or "" on nodes without it (the CPU node has no GPU labels)."""
    return f'"{key}" in node.metadata.labels ? node.metadata.labels["{key}"] : ""'


def _annotation_number(key: str) -> str:
    return f'"{key}" in node.metadata.annotations ? double(node.metadata.annotations["{key}"]) : 0.0'


# dcgm-exporter's series the canary reads: (name, help, the node annotation that gives the value)
DCGM_SERIES = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gpucanary.io/simulated-gpu-util"),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "gpucanary.io/simulated-xid"),
)
KUBELET_DCGM_PATH = "/metrics/dcgm"  # the node agent's DCGM series of the kubelet pool nodes


def dcgm_metric(gpus_per_node: int = 8) -> dict:
    """DCGM exporter-style series per GPU, served by kwok for every node at /metrics/nodes/<node>/metrics/dcgm.

    DCGM_FI_DRIVER_VERSION is a label, as in dcgm-exporter's DCP metrics; it follows the node's
    GFD driver label, which the fleet's node agent keeps at the version of the Ready driver pod.
    Utilisation and the last XID come from node annotations, so a test can inject an XID error.
    """
    metrics = []
    for name, help_text, annotation in DCGM_SERIES:
        value = _annotation_number(annotation)
        for gpu in range(gpus_per_node):
            metrics.append(
                {
                    "name": name,
                    "help": help_text,
                    "kind": "gauge",
                    "dimension": "node",
                    "labels": [
                        {"name": "gpu", "value": f'"{gpu}"'},
                        {"name": "UUID", "value": f'"GPU-" + node.metadata.name + "-{gpu}"'},
                        {"name": "Hostname", "value": "node.metadata.name"},
                        {"name": "modelName", "value": _label("nvidia.com/gpu.product")},
                        {"name": "DCGM_FI_DRIVER_VERSION", "value": _label("nvidia.com/cuda.driver-version.full")},
                    ],
                    "value": value,
                }
            )
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Metric",
        "metadata": {"name": "dcgm"},
        "spec": {"path": "/metrics/nodes/{nodeName}/metrics/dcgm", "metrics": metrics},
    }


def node(template: str, name: str) -> dict:
    manifest = yaml.safe_load((FLEET_FIXTURES / template).read_text())
    manifest["metadata"]["name"] = name
    manifest["metadata"]["labels"]["kubernetes.io/hostname"] = name
    return manifest


def gpu_node(name: str, *, dra: bool) -> dict:
    """A KWOK GPU node; in GPUCluster mode (`dra`) without nvidia.com/gpu, which no device plugin there registers:
    its GPUs are the DRA kubelet plugin's ResourceSlices."""
    manifest = node("gpu-node.yaml", name)
    if dra:
        for resources in (manifest["status"]["allocatable"], manifest["status"]["capacity"]):
            del resources[GPU_RESOURCE]
    return manifest


def fleet_nodes(layout: FleetLayout) -> list[dict]:
    gpu = [gpu_node(gpu_node_name(i), dra=layout.dra) for i in range(layout.gpu_nodes)]
    return gpu + [node("cpu-node.yaml", CPU_NODE_NAME)]


def audit_policy() -> str:
    """One Metadata event per request (who, verb, object, user agent, status, µs timestamps).

    RequestReceived is omitted: every request also logs ResponseComplete (and a watch
    ResponseStarted), which carry the same fields plus the status. No response bodies; request bodies
    only of patches and updates of Node objects (not nodes/status, where kwok's heartbeats go): the
    fault tests read from them which upgrade-state label the operator set, to prove the recorder
    missed no transition of a pool node; and of pod status writes, so the log says when a pod was
    made Running (the canary's start latency, measured from the server's side).
    """
    node_writes = {
        "level": "Request",
        "verbs": ["patch", "update"],
        "resources": [{"group": "", "resources": ["nodes"]}],
    }
    policy = {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "omitManagedFields": True,
        "rules": [
            node_writes,
            {
                "level": "Request",
                "verbs": ["patch", "update"],
                "resources": [{"group": "", "resources": ["pods/status"]}],
            },
            {"level": "Metadata"},
        ],
    }
    return yaml.safe_dump(policy, sort_keys=False)


LARGE_FLEET_GPU_NODES = 64
FLEET_NODE_PATH = "/metrics/nodes/(gpu|cpu)-node-[0-9]+/.*"  # the fleet's own nodes, not a canary's pool


def _dcgm_scrape_jobs(layout: FleetLayout, client_tls: dict) -> list[dict]:
    """DCGM series from kwok, every 5 s. Beyond 64 GPU nodes the fleet's own nodes go to a 60 s job:
    at 1,000 nodes a 5 s scrape of all is 200 scrapes/s of CEL-evaluated metrics, most of two cores,
    while the canary only reads its pool's series (new nodes, still every 5 s)."""
    sd = {
        "url": f"https://{HOST}:{layout.port('kwok')}/discovery/prometheus",
        "refresh_interval": "5s",  # nodes come and go with pools
        "tls_config": client_tls,
    }
    job = {"job_name": "kwok-metrics", "scheme": "https", "tls_config": client_tls, "http_sd_configs": [sd]}
    if layout.gpu_nodes <= LARGE_FLEET_GPU_NODES:
        return [job]
    path = {"source_labels": ["__metrics_path__"], "regex": FLEET_NODE_PATH}
    return [
        {**job, "relabel_configs": [{**path, "action": "drop"}]},
        {
            **job,
            "job_name": "kwok-metrics-fleet",
            "scrape_interval": "60s",
            "scrape_timeout": "30s",
            "relabel_configs": [{**path, "action": "keep"}],
        },
    ]


def prometheus_config(layout: FleetLayout) -> str:
    pki = layout.pki
    client_tls = {
        "ca_file": str(pki / "ca.crt"),
        "cert_file": str(pki / "admin.crt"),
        "key_file": str(pki / "admin.key"),
        "insecure_skip_verify": True,
    }
    config = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "scrape_configs": [
            {
                "job_name": "apiserver",
                "scheme": "https",
                "tls_config": client_tls,
                "static_configs": [{"targets": [f"{HOST}:{layout.port('kube-apiserver')}"]}],
            },
            *_dcgm_scrape_jobs(layout, client_tls),
            *(
                [
                    {
                        "job_name": "kubelet-dcgm",
                        "metrics_path": KUBELET_DCGM_PATH,
                        "static_configs": [{"targets": [f"{HOST}:{layout.port('node-agent')}"]}],
                    }
                ]
                if layout.kubelet_pool and layout.kubelet_nodes
                else []
            ),
            {
                "job_name": "gpu-operator",
                "static_configs": [{"targets": [f"{HOST}:{layout.port('gpu-operator-metrics')}"]}],
            },
            {"job_name": "fleet-ingress", "static_configs": [{"targets": [f"{HOST}:{layout.port('ingress')}"]}]},
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def host_network_service(port: int) -> str:
    """fixtures/workloads/service.yaml for a real kubelet node: its pods have no route to the host,
    so the server runs with hostNetwork on 127.0.0.1:`port` (one of the fleet's kubelet workload
    ports), where the kubelet's readiness probe and the fleet's ingress reach it."""
    docs = list(yaml.safe_load_all((FIXTURES / "workloads" / "service.yaml").read_text()))
    for doc in docs:
        if doc["kind"] == "Deployment":
            spec = doc["spec"]["template"]["spec"]
            spec["hostNetwork"] = True
            [container] = spec["containers"]
            container["args"] = ["netexec", f"--http-port={port}"]
            container["ports"] = [{"containerPort": port, "name": "http"}]
            container["readinessProbe"]["httpGet"]["host"] = HOST
    return yaml.safe_dump_all(docs, sort_keys=False)
