"""deploy/ grants exactly what the run, cleanup and preflight ask for: no rule more, no rule less; every write a
ClusterRole grants is pinned by an admission policy; what the canary writes fits them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pytest_gpucanary.canary import workloads
from pytest_gpucanary.canary.publish import NAMESPACE as VERDICT_NAMESPACE
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.fleet.kwok_pool import KWOK_POOL_PERMISSIONS
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import owned_namespace
from pytest_gpucanary.shipped import REPO_ROOT
from pytest_gpucanary.canary.preflight import (ADMISSION_POLICIES, PERMISSIONS, ClusterInfo, Permission, admission_note,
                                        missing_permissions)
from pytest_gpucanary.canary.workloads import PRIORITY_CLASS_MANIFEST, WORKLOADS


def granted(path: str) -> set[tuple[str, str, str, str, str]]:
    found = set()
    for doc in yaml.safe_load_all((REPO_ROOT / path).read_text()):
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        scope = ("cluster" if doc["kind"] == "ClusterRole"
                 else "verdicts" if doc["metadata"]["namespace"] == VERDICT_NAMESPACE else "operator")
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames", [""]):
                            found.add((verb, group, resource, name, scope))
    return found


def needed(permissions: tuple[Permission, ...]) -> set[tuple[str, str, str, str, str]]:
    return {(p.verb, p.group, p.resource, p.name, p.scope) for p in permissions}


def test_the_shipped_roles_grant_exactly_the_permissions_the_preflight_checks() -> None:
    assert granted("deploy/rbac.yaml") == needed(tuple(p for p in PERMISSIONS if not p.writes_cluster_policy))
    assert granted("deploy/rbac-clusterpolicy-mode.yaml") == needed(tuple(p for p in PERMISSIONS
                                                                         if p.writes_cluster_policy))


OPERATIONS = {"create": "CREATE", "patch": "UPDATE", "update": "UPDATE", "delete": "DELETE"}
CANARY_GROUP = '"system:serviceaccounts:gpucanary" in request.userInfo.groups'


def pinned(path: str) -> set[tuple[str, str, str]]:
    """(group, resource, operation) that a Deny-bound policy of the file checks for the canary's ServiceAccounts."""
    docs = list(yaml.safe_load_all((REPO_ROOT / path).read_text()))
    denying = {d["spec"]["policyName"] for d in docs
               if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["spec"]["validationActions"] == ["Deny"]
               and not d["spec"].get("matchResources")}
    found = set()
    for doc in docs:
        if doc["kind"] != "ValidatingAdmissionPolicy" or doc["metadata"]["name"] not in denying:
            continue
        assert doc["spec"]["failurePolicy"] == "Fail" and doc["spec"]["validations"]
        assert [c["expression"] for c in doc["spec"]["matchConditions"]] == [CANARY_GROUP]
        for rule in doc["spec"]["matchConstraints"]["resourceRules"]:
            found |= {(g, r, o) for g in rule["apiGroups"] for r in rule["resources"] for o in rule["operations"]}
    return found


def test_every_cluster_wide_write_is_pinned_by_an_admission_policy() -> None:
    """RBAC cannot name a run's namespaces before they exist, nor limit a patch to some fields: each write a
    ClusterRole grants (create, patch, delete in every namespace or on cluster-scoped kinds) is checked, for the
    canary's ServiceAccounts, by a policy of deploy/admission.yaml that denies what a run does not do."""
    policies = pinned("deploy/admission.yaml")
    writes = {(group, resource, OPERATIONS[verb])
              for verb, group, resource, _, scope in granted("deploy/rbac.yaml") | granted("deploy/rbac-clusterpolicy-mode.yaml")
              if scope == "cluster" and verb in OPERATIONS}
    assert writes and writes <= policies, sorted(writes - policies)


def test_the_cluster_policy_is_patched_by_name_only() -> None:
    rules = granted("deploy/rbac.yaml") | granted("deploy/rbac-clusterpolicy-mode.yaml")
    assert [r for r in rules if r[2] == "clusterpolicies" and r[0] == "patch"] == [
        ("patch", "nvidia.com", "clusterpolicies", "cluster-policy", "cluster")]


def test_the_local_fleet_kwok_pool_adds_only_its_nodes_and_nvidiadrivers() -> None:
    assert granted("deploy/local-fleet-kwok-pool.yaml") == needed(KWOK_POOL_PERMISSIONS)


def test_no_rule_grants_wildcards_or_secrets() -> None:
    """ConfigMaps only in the canary's own namespace, where it keeps its verdicts."""
    rules = granted("deploy/rbac.yaml") | granted("deploy/rbac-clusterpolicy-mode.yaml") | granted(
        "deploy/local-fleet-kwok-pool.yaml")
    assert not [r for r in rules if "*" in r or r[2] == "secrets" or (r[2] == "configmaps" and r[4] != "verdicts")]
    assert {r[0] for r in rules if r[2] == "configmaps"} == {"get", "create", "patch"}


def test_the_shipped_priority_class_is_the_one_the_canary_pods_name() -> None:
    shipped = yaml.safe_load((REPO_ROOT / "deploy" / "priorityclass.yaml").read_text())
    assert shipped == PRIORITY_CLASS_MANIFEST
    assert shipped["value"] < 0 and shipped["preemptionPolicy"] == "Never" and shipped["globalDefault"] is False


class Asked:
    """A client that can do everything and notes each SelfSubjectAccessReview it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, str | None, str | None]] = []

    def can_i(self, verb: str, resource: str, *, group: str = "", namespace: str | None = None,
              name: str | None = None) -> bool:
        self.asked.append((verb, resource, namespace, name))
        return resource != "daemonsets"


def cluster(*, nvidiadriver_mode: bool, per_driver_policy: bool) -> ClusterInfo:
    return ClusterInfo(cluster_policy="my-policy", nvidiadriver_mode=nvidiadriver_mode,
                       per_driver_policy=per_driver_policy, operator_namespace="nvidia-gpu", gpu_nodes=())


@pytest.mark.parametrize(("nvidiadriver_mode", "per_driver_policy", "patches_policy", "daemonsets"), [
    (True, True, False, False),      # v26.7+: only the pool's NVIDIADriver is written
    (True, False, True, False),      # before v26.7: the ClusterPolicy's upgradePolicy too
    (False, False, True, True),      # ClusterPolicy mode: and the driver DaemonSets are waited for
])
def test_the_preflight_asks_for_the_clusterpolicy_mode_rules_only_where_the_run_writes_the_cluster_policy(
        nvidiadriver_mode: bool, per_driver_policy: bool, patches_policy: bool, daemonsets: bool) -> None:
    kube = Asked()
    problems = missing_permissions(kube, PERMISSIONS, cluster(nvidiadriver_mode=nvidiadriver_mode,
                                                              per_driver_policy=per_driver_policy))
    # the ClusterPolicy the cluster has, by its own name, not the chart's
    assert (("patch", "clusterpolicies", None, "my-policy") in kube.asked) is patches_policy
    assert [p.line for p in problems] == ([
        "missing permission: list daemonsets.apps in the operator's namespace (to wait for the driver DaemonSets on "
        "restore); grant the rules of deploy/rbac-clusterpolicy-mode.yaml",
        "missing permission: watch daemonsets.apps in the operator's namespace (to wait for the driver DaemonSets on "
        "restore); grant the rules of deploy/rbac-clusterpolicy-mode.yaml"] if daemonsets else [])


def test_a_service_manifest_with_a_kind_the_rules_do_not_grant_is_refused_before_the_cluster_is_touched(
        tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((WORKLOADS / "service.yaml").read_text()))
    (tmp_path / "service.yaml").write_text(yaml.safe_dump_all([*docs, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "x"}}]))
    with pytest.raises(ConfigError) as refused:
        workloads.service(tmp_path / "service.yaml", workloads.Placement("gpucanary-r", "r", "n"))
    assert str(refused.value).startswith(f"service manifest {tmp_path / 'service.yaml'} holds a ClusterRoleBinding: "
                                         "the canary creates only Deployment, Service, PodDisruptionBudget")


def test_run_namespaces_enforce_baseline_unless_a_pod_of_the_run_needs_the_host() -> None:
    placement = workloads.Placement("gpucanary-r", "r", "n")
    shipped = workloads.service(None, placement)
    assert workloads.pod_security(shipped) == "baseline"
    host = [*shipped]
    [deployment] = [d for d in host if d["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["hostNetwork"] = True
    assert workloads.pod_security(host) == "privileged"
    namespace = owned_namespace("gpucanary-r", "r")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert namespace["metadata"]["labels"]["gpucanary.io/run-id"] == "r"


def test_the_preflight_reads_back_every_shipped_admission_policy_and_its_binding() -> None:
    docs = list(yaml.safe_load_all((REPO_ROOT / "deploy" / "admission.yaml").read_text()))
    policies = {d["metadata"]["name"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {d["metadata"]["name"]: d["spec"]["policyName"] for d in docs
                if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert policies == set(ADMISSION_POLICIES) and bindings == {name: name for name in ADMISSION_POLICIES}


class Holds:
    """A client whose cluster holds exactly the named admission objects."""

    def __init__(self, *names: tuple[str, str]) -> None:
        self.names = set(names)

    def get(self, api_version: str, kind: str, name: str) -> dict:
        if (kind, name) not in self.names:
            raise NotFound(f"get {kind} {name}: 404")
        return {"metadata": {"name": name}}


def test_the_preflight_says_whether_the_apiserver_enforces_the_admission_policies() -> None:
    every = [(kind, name) for name in ADMISSION_POLICIES
             for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]
    assert admission_note(Holds(*every)) == "the apiserver enforces deploy/admission.yaml (8 policies, bound)"
    unbound = admission_note(Holds(*[o for o in every if o != ("ValidatingAdmissionPolicyBinding", "gpucanary-nodes")]))
    assert unbound.startswith("the apiserver does not enforce deploy/admission.yaml (1 of 16 objects missing, e.g. "
                              "ValidatingAdmissionPolicyBinding gpucanary-nodes)")


def test_widen_runs_as_its_own_account_with_the_canarys_grants_and_the_rollbacks_daemonsets() -> None:
    """deploy/rbac-widen.yaml: the canary's ClusterRole and verdict Role bound to gpucanary-widen, and of its own
    exactly what a run that writes the ClusterPolicy adds (the DaemonSets a rollback waits for in either mode)."""
    assert granted("deploy/rbac-widen.yaml") == granted("deploy/rbac-clusterpolicy-mode.yaml")
    bound = {(doc["roleRef"]["kind"], doc["roleRef"]["name"])
             for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / "rbac-widen.yaml").read_text())
             if doc["kind"] in ("ClusterRoleBinding", "RoleBinding")
             and doc["subjects"] == [{"kind": "ServiceAccount", "name": "gpucanary-widen", "namespace": "gpucanary"}]}
    assert bound == {("ClusterRole", "gpucanary"), ("Role", "gpucanary-verdicts"), ("ClusterRole", "gpucanary-widen"),
                     ("Role", "gpucanary-widen")}
