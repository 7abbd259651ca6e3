"""GPUs that a cluster allocates through Dynamic Resource Allocation (resource.k8s.io/v1, GA in Kubernetes 1.34),
found before a run: the nodes for which NVIDIA's DRA driver publishes ResourceSlices.

Where the pool's nodes offer GPUs this way the run's GPU job claims its GPU through DRA (`claims`); elsewhere it
requests the extended resource `nvidia.com/gpu`, and a verdict on such a pool does not speak for pods that hold a
`gpu.nvidia.com` ResourceClaim: those pods are said, not hidden. Before GPU Operator v26.7
the pod deletion filter (`gpuPodSpecFilter`, cmd/gpu-operator/main.go) matches `nvidia.com/gpu` and
`nvidia.com/mig-*` resources only, so it never deletes a claim-holding pod and only a drain evicts one; v26.7.0
also counts a pod with an allocated `gpu.nvidia.com` claim (`PodHasNVIDIAGPUClaim`).
"""

from __future__ import annotations

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary.recorder import StreamSpec
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Forbidden, NotFound
from pytest_gpucanary.ladder.slices import GPU_DRIVER, KIND, stream_name

RESOURCE_SLICE = ("resource.k8s.io/v1", KIND)
NOTE_LEAD = "node(s) offer GPUs through DRA"
POD_DELETION_SEES_CLAIMS = (26, 7)  # the first release whose pod deletion counts claim-holding pods


def gpu_nodes(kube: Kube) -> tuple[str, ...]:
    """The nodes with a ResourceSlice of NVIDIA's GPU driver, sorted; none where resource.k8s.io/v1 is not served
    (or the canary may not list it: preflight names that permission)."""
    try:
        slices = kube.list(*RESOURCE_SLICE, field_selector=f"spec.driver={GPU_DRIVER}")
    except (NotFound, Forbidden):
        return ()
    return tuple(sorted({name for s in slices if (name := (s.get("spec") or {}).get("nodeName"))}))


def offer_gpus(kube: Kube, pool_nodes: tuple[str, ...]) -> bool:
    """Whether every pool node offers its GPUs through DRA: then the run's GPU job claims them (`claims`)."""
    return bool(pool_nodes) and set(pool_nodes) <= set(gpu_nodes(kube))


def slice_streams(kube: Kube, nodes: tuple[str, ...]) -> list[StreamSpec]:
    """A watch of each pool node's GPU ResourceSlices, where the cluster serves them and the canary may read them:
    the device rung wants them gone and back at the target on a node that offers its GPUs through DRA."""
    try:
        kube.list(*RESOURCE_SLICE, field_selector=f"spec.driver={GPU_DRIVER}", limit=1)
    except (NotFound, Forbidden):
        return []
    return [
        StreamSpec(stream_name(node), *RESOURCE_SLICE, field_selector=f"spec.nodeName={node},spec.driver={GPU_DRIVER}")
        for node in nodes
    ]


def note(nodes: tuple[str, ...], release: str | None) -> str:
    """What a run on this cluster does not prove, in one line."""
    names = ", ".join(nodes[:5]) + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
    series = op.release_series(release) if release else None
    blind = (
        f"; on GPU Operator {release} pod deletion never deletes a claim-holding pod (it matches extended "
        "resources only), so only a drain evicts one"
        if series is not None and series < POD_DELETION_SEES_CLAIMS
        else ""
    )
    return (
        f"{len(nodes)} {NOTE_LEAD} ({GPU_DRIVER} ResourceSlices: {names}): the canary's GPU job claims its GPU "
        f"through DRA only where the pool's nodes offer GPUs this way: a run on a device-plugin pool does not "
        f"speak for pods holding a {GPU_DRIVER} ResourceClaim{blind}"
    )
