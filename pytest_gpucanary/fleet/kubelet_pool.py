"""The fleet's real kubelet nodes as a canary pool (the `kubelet` pool provider, the fleet's default).

A kubelet pool node is an existing node to the canary: carved out, its labels and schedulability
saved on it and restored, its driver back at its version before it is given back. What differs
is the network: pods there have no route to the host, so the canary's default service runs with
hostNetwork on 127.0.0.1, on the node's own service port, where the fleet's ingress proxies to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pytest_gpucanary.canary.pool import DRIVER_POOL_LABEL, Pool
from pytest_gpucanary.canary.pool.existing_node import ExistingNodeProvider
from pytest_gpucanary.cluster import ClusterInfo
from pytest_gpucanary.config import Settings
from pytest_gpucanary.fleet.kubelet_node import NODE_KIND_LABEL, node_name
from pytest_gpucanary.fleet.layout import FleetLayout
from pytest_gpucanary.fleet.manifests import host_network_service
from pytest_gpucanary.kube import Kube

KUBELET_POOL_SELECTOR = f"{NODE_KIND_LABEL}=kubelet,{DRIVER_POOL_LABEL}"


@dataclass
class KubeletPoolProvider(ExistingNodeProvider):
    layout: FleetLayout | None = None
    name: str = "kubelet"

    @classmethod
    def for_fleet(cls, settings: Settings, layout: FleetLayout) -> KubeletPoolProvider:
        return cls(
            node=settings.pool_node,
            selector=None if settings.pool_node else KUBELET_POOL_SELECTOR,
            size=settings.pool_size,
            allow_foreign_pods=settings.allow_foreign_pods,
            restore_timeout_s=settings.upgrade_budget_s,
            layout=layout,
        )

    def provision(self, kube: Kube, cluster: ClusterInfo, *, run_id: str) -> Pool:
        pool = super().provision(kube, cluster, run_id=run_id)
        layout = self.layout
        names = [node_name(i) for i in range(layout.kubelet_nodes)] if layout else []
        # not one of the fleet's kubelet nodes: its pods have a network of their own
        if layout is None or pool.nodes[0] not in names:
            return pool
        index = names.index(pool.nodes[0])
        path = layout.run / f"{pool.nodes[0]}-service.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(host_network_service(layout.kubelet_service_port(index)))
        return replace(pool, service=path)
