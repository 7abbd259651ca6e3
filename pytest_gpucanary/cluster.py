"""What the target's GPU Operator is: its mode, release, namespace and GPU nodes, read once and only read."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Forbidden, NotFound


@dataclass(frozen=True)
class ClusterInfo:
    cluster_policy: str | None  # name of the ClusterPolicy; None in GPUCluster mode, which has none
    nvidiadriver_mode: bool  # spec.driver.useNvidiaDriverCRD, or a GPUCluster (drivers from NVIDIADriver CRs only)
    per_driver_policy: bool  # NVIDIADriver has spec.upgradePolicy (operator v26.7+)
    operator_namespace: str
    gpu_nodes: tuple[str, ...]  # nodes labelled nvidia.com/gpu.present=true
    operator_release: str | None = None  # from the ClusterPolicy's (GPUCluster's) Helm labels; None when none
    gpu_cluster: str | None = None  # name of the GPUCluster (v26.7): NVIDIA's DRA driver instead of a ClusterPolicy

    @property
    def mode(self) -> str:
        if self.gpu_cluster:
            return "GPUCluster"
        return "NVIDIADriver" if self.nvidiadriver_mode else "ClusterPolicy"

    @property
    def policy_name(self) -> str:
        """The ClusterPolicy's name, for what reads or writes it: ClusterPolicy mode, or a cluster-wide policy before
        v26.7, neither of which a GPUCluster has."""
        if self.cluster_policy is None:
            raise EnvError(f"the GPU Operator runs by GPUCluster {self.gpu_cluster}, which has no ClusterPolicy")
        return self.cluster_policy

    @property
    def writes_cluster_policy(self) -> bool:
        """Whether a change of the policy writes the ClusterPolicy: in its mode, and for the cluster-wide policy
        before v26.7."""
        return not self.nvidiadriver_mode or not self.per_driver_policy


def _configuration(kube: Kube) -> tuple[dict, bool]:
    """The one object that configures the operator: its ClusterPolicy, or in GPUCluster mode (v26.7, Helm
    `gpuCluster.deployCR=true`) its GPUCluster, and whether it is one. The operator refuses both at once
    (controllers/gpucluster_controller.go validatePrerequisites), and so does the canary."""
    try:
        policies = kube.list(*op.CLUSTER_POLICY)
    except NotFound as err:
        raise EnvError("the cluster has no ClusterPolicy API", hint="install the NVIDIA GPU Operator first") from err
    try:
        clusters = kube.list(*op.GPU_CLUSTER)
    except NotFound:  # before v26.7
        clusters = []
    except Forbidden:  # an identity granted before GPUCluster: a ClusterPolicy rules one out (the operator's rule)
        if not policies:
            raise EnvError(
                "the cluster has no ClusterPolicy, and this identity may not list GPUClusters",
                hint="grant it list on gpuclusters.nvidia.com (deploy/rbac.yaml)",
            ) from None
        clusters = []
    if policies and clusters:
        raise EnvError(
            "the cluster has both a ClusterPolicy and a GPUCluster, which the GPU Operator refuses",
            hint="delete the one the operator should not run by",
        )
    found = policies or clusters
    if len(found) != 1:
        raise EnvError(
            f"expected one ClusterPolicy, found {len(policies)}"
            + (f" and {len(clusters)} GPUClusters" if clusters else ""),
            hint="the GPU Operator manages exactly one (or, from v26.7, one GPUCluster)",
        )
    return found[0], not policies


def operator_release(kube: Kube) -> str | None:
    """The GPU Operator release, as its ClusterPolicy's (GPUCluster's) Helm labels name it (None if they do not)."""
    return op.release_of(_configuration(kube)[0]["metadata"].get("labels") or {})


def discover(kube: Kube) -> ClusterInfo:
    policy, is_gpu_cluster = _configuration(kube)
    gpu_cluster = policy["metadata"]["name"] if is_gpu_cluster else None
    # one operand pod names the operator's namespace: a request of constant size on any cluster
    operand = kube.list("v1", "Pod", label_selector=op.DRIVER_COMPONENT_SELECTOR, limit=1) or kube.list(
        "v1", "Pod", label_selector=op.VALIDATOR_SELECTOR, limit=1
    )
    if not operand:
        raise EnvError(
            "cannot tell the GPU Operator's namespace (no driver or validator pod)",
            hint="is the GPU Operator running and ready?",
        )
    nvidiadriver_mode = bool(gpu_cluster or policy.get("spec", {}).get("driver", {}).get("useNvidiaDriverCRD"))
    # only ClusterPolicy mode holds the other GPU nodes back, so only it needs them all
    nodes = [] if nvidiadriver_mode else kube.each("v1", "Node", label_selector=op.GPU_PRESENT_SELECTOR)
    return ClusterInfo(
        cluster_policy=None if gpu_cluster else policy["metadata"]["name"],
        gpu_cluster=gpu_cluster,
        nvidiadriver_mode=nvidiadriver_mode,
        per_driver_policy=_nvidiadriver_has_upgrade_policy(kube),
        operator_namespace=operand[0]["metadata"]["namespace"],
        gpu_nodes=tuple(sorted(n["metadata"]["name"] for n in nodes)),
        operator_release=_drivable(op.release_of(policy["metadata"].get("labels") or {})),
    )


def _drivable(release: str | None) -> str | None:
    """The release, unless it is one the canary cannot drive: then one line, before anything is touched."""
    series = op.release_series(release) if release else None
    if series is not None and series < op.OLDEST_DRIVABLE:
        raise EnvError(
            f"GPU Operator {release} is older than the releases the canary knows how to drive",
            hint=f"upgrade the operator to v25.3 or later (proven: {', '.join(op.PROVEN_RELEASES)})",
        )
    return release


def _nvidiadriver_has_upgrade_policy(kube: Kube) -> bool:
    try:
        crd = kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", op.NVIDIADRIVER_CRD)
    except NotFound:
        return False
    versions = crd["spec"]["versions"]
    return any(
        "upgradePolicy"
        in v.get("schema", {}).get("openAPIV3Schema", {}).get("properties", {}).get("spec", {}).get("properties", {})
        for v in versions
    )
