"""What the canary reads of the target's GPU Operator before anything else: its mode, release and namespace, from its
ClusterPolicy or, in GPUCluster mode (v26.7: NVIDIA's DRA driver, drivers from NVIDIADriver CRs), from its GPUCluster.
The operator refuses both at once, and so does the canary, in one line and before it writes anything."""

from __future__ import annotations

import pytest
from kube_double import FakeKube

from pytest_gpucanary.cluster import discover, operator_release
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube.errors import Forbidden

RELEASE_LABELS = {"app.kubernetes.io/name": "gpu-operator", "app.kubernetes.io/version": "v26.7.0"}


def _operator(fake: FakeKube, *, cluster_policy: bool, gpu_cluster: bool) -> None:
    fake.create({"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "nvidia-gpu-driver-x", "namespace": "gpu-operator",
                              "labels": {"app.kubernetes.io/component": "nvidia-driver"}},
                 "spec": {"containers": []}})
    fake.create({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                 "metadata": {"name": "nvidiadrivers.nvidia.com"},
                 "spec": {"versions": [{"schema": {"openAPIV3Schema": {"properties": {"spec": {
                     "properties": {"upgradePolicy": {}}}}}}}]}})
    if cluster_policy:
        fake.create({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
                     "metadata": {"name": "cluster-policy", "labels": RELEASE_LABELS},
                     "spec": {"driver": {"useNvidiaDriverCRD": True}}})
    if gpu_cluster:
        fake.create({"apiVersion": "nvidia.com/v1alpha1", "kind": "GPUCluster",
                     "metadata": {"name": "gpu-cluster", "labels": RELEASE_LABELS},
                     "spec": {"draDriver": {"version": "v0.5.0"}}})


def test_a_gpucluster_is_nvidiadriver_mode_with_no_cluster_policy_and_its_release_from_its_labels() -> None:
    fake = FakeKube()
    _operator(fake, cluster_policy=False, gpu_cluster=True)

    cluster = discover(fake)

    assert (cluster.mode, cluster.gpu_cluster, cluster.cluster_policy) == ("GPUCluster", "gpu-cluster", None)
    assert cluster.nvidiadriver_mode and cluster.per_driver_policy and not cluster.writes_cluster_policy
    assert cluster.operator_release == operator_release(fake) == "v26.7.0"
    assert cluster.operator_namespace == "gpu-operator"
    with pytest.raises(EnvError, match="runs by GPUCluster gpu-cluster, which has no ClusterPolicy"):
        cluster.policy_name


def test_a_cluster_policy_is_read_as_before() -> None:
    fake = FakeKube()
    _operator(fake, cluster_policy=True, gpu_cluster=False)
    cluster = discover(fake)
    assert (cluster.mode, cluster.gpu_cluster, cluster.policy_name) == ("NVIDIADriver", None, "cluster-policy")


def test_both_or_neither_is_one_line_and_no_write() -> None:
    for cluster_policy, gpu_cluster, said in (
        (True, True, "the cluster has both a ClusterPolicy and a GPUCluster, which the GPU Operator refuses"),
        (False, False, "expected one ClusterPolicy, found 0"),
    ):
        fake = FakeKube()
        _operator(fake, cluster_policy=cluster_policy, gpu_cluster=gpu_cluster)
        writes = len(fake.writes)
        with pytest.raises(EnvError, match=said):
            discover(fake)
        assert len(fake.writes) == writes


class NoGpuClusterGrant(FakeKube):
    """An identity granted before GPUCluster existed: listing them is forbidden."""

    def list(self, api_version: str, kind: str, **kwargs):
        if kind == "GPUCluster":
            raise Forbidden("list GPUCluster: 403 forbidden")
        return super().list(api_version, kind, **kwargs)


def test_an_identity_that_may_not_list_gpuclusters_still_reads_a_cluster_policy_and_is_told_otherwise() -> None:
    """A ClusterPolicy rules a GPUCluster out (the operator refuses both), so an older grant still reads it; with no
    ClusterPolicy the line names the missing grant instead of a missing ClusterPolicy."""
    fake = NoGpuClusterGrant()
    _operator(fake, cluster_policy=True, gpu_cluster=False)
    assert discover(fake).mode == "NVIDIADriver" and operator_release(fake) == "v26.7.0"

    fake = NoGpuClusterGrant()
    _operator(fake, cluster_policy=False, gpu_cluster=True)
    with pytest.raises(EnvError, match="no ClusterPolicy, and this identity may not list GPUClusters"):
        discover(fake)
