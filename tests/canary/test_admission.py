"""What the apiserver refuses the canary's own token: with deploy/ applied (RBAC and admission policies), a
battery of writes outside the pool is each refused, by RBAC or by an admission policy as the audit log shows,
while the writes a run makes on its own objects still go through. The battery's writes are dry runs: a policy
that failed would still change nothing. (Whole gates pass under the same rules and token, from the installed
wheel: test_installed_package.py.)
"""

from __future__ import annotations

import copy
import json
import time
import uuid

import pytest

from pytest_gpucanary.canary.claims import RESOURCE_CLAIM_TEMPLATE, template
from pytest_gpucanary.canary.neighbours import NVSENTINEL_LABEL
from pytest_gpucanary.canary.pool import DRIVER_POOL_LABEL, POOL_ELIGIBLE_LABEL
from pytest_gpucanary.cluster import discover
from testbed.audit import read_log
from pytest_gpucanary.gpu_operator import CLUSTER_POLICY, NVIDIADRIVER, unplaced
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import owned_labels, owned_namespace
from pytest_gpucanary.shipped import FIXTURES
from harness import TARGET, gpucanary

pytestmark = [pytest.mark.e2e]

ACCOUNT = "gpucanary-adversary"
USER = f"system:serviceaccount:gpucanary:{ACCOUNT}"
USER_AGENT = f"gpucanary-adversary/{uuid.uuid4().hex[:6]}"     # its requests alone, found fast in the audit log
LEASE = "coordination.k8s.io/v1"


def pod(name: str, namespace: str, *, container: dict | None = None, **spec: object) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "c", "image": "busybox:1.36", **(container or {})}], **spec}}


def test_writes_outside_the_pool_are_refused_by_the_apiserver(
        canary_service_account, gpucanary_fleet, kube: Kube, refused) -> None:
    kubeconfig = canary_service_account(ACCOUNT)
    canary = Kube.connect(kubeconfig, user_agent=USER_AGENT)
    # the preflight, under the same token, says the apiserver enforces them
    preflight = gpucanary("preflight", f"--gpucanary-kubeconfig={kubeconfig}", "--gpucanary-pool-provider=kwok",
                          f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                          f"--gpucanary-driver-version={TARGET}", unbuffered=False, timeout_s=120)
    assert preflight.returncode == 0, preflight.stdout + preflight.stderr
    assert "the apiserver enforces deploy/admission.yaml (8 policies, bound)" in json.loads(preflight.stdout)["notes"]
    cluster = discover(kube)
    ops = cluster.operator_namespace
    tag = uuid.uuid4().hex[:6]
    nodes = kube.list("v1", "Node")
    other = next(n["metadata"]["name"] for n in nodes if n["metadata"]["labels"].get(POOL_ELIGIBLE_LABEL) != "true")
    eligible = next(n["metadata"]["name"] for n in nodes if n["metadata"]["labels"].get(POOL_ELIGIBLE_LABEL) == "true")
    an_operator_pod = kube.list("v1", "Pod", namespace=ops)[0]["metadata"]["name"]
    own = f"gpucanary-adversary-{tag}"      # the canary's own namespace, as a run makes it
    driver = f"adversary-{tag}"             # an NVIDIADriver an administrator marked for canary pools
    if cluster.nvidiadriver_mode:
        kube.create({"apiVersion": "nvidia.com/v1alpha1", "kind": "NVIDIADriver",
                     "metadata": {"name": driver, "labels": {POOL_ELIGIBLE_LABEL: "true"}},
                     "spec": {**{k: v for k, v in kube.get(*NVIDIADRIVER, "fleet")["spec"].items() if k != "default"},
                              "nodeSelector": {DRIVER_POOL_LABEL: driver}}})   # the fleet's may be the default one
    unplaced = kube.create(unplaceable_daemonset(f"unplaced-{tag}", ops, other))
    since_s = time.time()
    try:
        # what a run writes on its own objects goes through, under the same token
        canary.create(owned_namespace(own, "adversary"))
        # a namespace where the apiserver itself would let a claim ask for admin access: only the policy refuses it
        kube.patch("v1", "Namespace", own, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}})
        claim_template = template(1, own, "adversary")
        admin_access = copy.deepcopy(claim_template)
        admin_access["spec"]["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
        never_ran = next_unplaced_pod(kube, ops, unplaced["metadata"]["name"])
        allowed = [
            ("create", "v1", "Pod", {"body": {**pod("plain", own), "metadata": {
                "name": "plain", "namespace": own, "labels": owned_labels("adversary")}}, "namespace": own}),
            ("patch", "v1", "Node", {"name": eligible, "body": {"metadata": {
                "labels": {"gpucanary.io/run-id": "adversary", NVSENTINEL_LABEL: "false"},
                "annotations": {"gpucanary.io/saved-node-state": "{}"}},
                "spec": {"taints": [*kube.get("v1", "Node", eligible)["spec"].get("taints", []),
                                    {"key": "gpucanary.io/run", "value": "adversary", "effect": "NoSchedule"}]}}}),
            ("patch", "v1", "Node", {"name": other, "body": {"metadata": {
                "labels": {"nvidia.com/gpu-driver-upgrade.skip": "true"}}}}),
            ("patch", *CLUSTER_POLICY, {"name": cluster.cluster_policy, "body": {"spec": {"driver": {
                "upgradePolicy": {"maxParallelUpgrades": 1}}}}}),
            # a DaemonSet's pod no node took, as the give-back deletes a pool node's driver pod that never placed
            ("delete", "v1", "Pod", {"name": never_ran, "namespace": ops}),
            # the GPU job's claim template on a pool that offers its GPUs through DRA
            ("create", *RESOURCE_CLAIM_TEMPLATE, {"body": claim_template, "namespace": own}),
        ]
        if cluster.nvidiadriver_mode:
            allowed.append(("patch", *NVIDIADRIVER, {"name": driver, "body": {
                "spec": {"version": TARGET, "labels": {"gpucanary.io/restart": "adversary"}},
                "metadata": {"annotations": {"gpucanary.io/saved-spec": "{}"}}}}))
        default = next((d for d in kube.list(*NVIDIADRIVER) if d["spec"].get("default")), None)
        if default is not None:     # a handover's NVIDIADriver, the default one's copy picking the run's nodes
            allowed.append(("create", *NVIDIADRIVER, {"body": handover_driver(default, "adversary")}))
        assert not [a for a in allowed if refused(canary, a[0], a[1], a[2], **a[3])], "a run's own write was refused"

        # what it must not do: refused by RBAC (not granted) or by deploy/admission.yaml
        battery = [
            # nodes: only the canary's marks, its run label and fence only on pool-eligible nodes
            ("admission", "a label on another node", "patch", "v1", "Node",
             {"name": other, "body": {"metadata": {"labels": {"evil": "x"}}}}),
            ("admission", "the run label on a node not eligible for pools", "patch", "v1", "Node",
             {"name": other, "body": {"metadata": {"labels": {"gpucanary.io/run-id": "x"}}}}),
            ("admission", "NVSentinel's opt-out on a node not eligible for pools", "patch", "v1", "Node",
             {"name": other, "body": {"metadata": {"labels": {NVSENTINEL_LABEL: "false"}}}}),
            ("admission", "a NoExecute taint on a pool node", "patch", "v1", "Node",
             {"name": eligible, "body": {"spec": {"taints": [{"key": "evil", "value": "x", "effect": "NoExecute"}]}}}),
            ("admission", "a cordon", "patch", "v1", "Node", {"name": eligible, "body": {"spec": {"unschedulable": True}}}),
            ("admission", "a foreign annotation on a node", "patch", "v1", "Node",
             {"name": other, "body": {"metadata": {"annotations": {"evil": "x"}}}}),
            ("admission", "the driver deploy label of a node", "patch", "v1", "Node",
             {"name": eligible, "body": {"metadata": {"labels": {"nvidia.com/gpu.deploy.driver": "false"}}}}),
            # the driver: only its version and policy
            ("admission", "the driver repository in the ClusterPolicy", "patch", *CLUSTER_POLICY,
             {"name": cluster.cluster_policy, "body": {"spec": {"driver": {"repository": "evil.example"}}}}),
            ("admission", "the toolkit in the ClusterPolicy", "patch", *CLUSTER_POLICY,
             {"name": cluster.cluster_policy, "body": {"spec": {"toolkit": {"enabled": False}}}}),
            # the operator's and the system's namespaces
            ("admission", "a pod in the operator's namespace", "create", "v1", "Pod",
             {"body": pod("evil", ops), "namespace": ops}),
            ("admission", "an operator pod deleted", "delete", "v1", "Pod", {"name": an_operator_pod, "namespace": ops}),
            ("admission", "a budget over the operator's pods", "create", "policy/v1", "PodDisruptionBudget",
             {"namespace": ops, "body": {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                                         "metadata": {"name": "evil", "namespace": ops},
                                         "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {}}}}}),
            ("admission", "a Lease in kube-system", "create", LEASE, "Lease",
             {"namespace": "kube-system", "body": {"apiVersion": LEASE, "kind": "Lease",
                                                   "metadata": {"name": "gpucanary-run", "namespace": "kube-system"}}}),
            ("rbac", "the scheduler's Lease", "patch", LEASE, "Lease",
             {"name": "kube-scheduler", "namespace": "kube-system", "body": {"spec": {"holderIdentity": "evil"}}}),
            ("admission", "the operator's namespace deleted", "delete", "v1", "Namespace", {"name": ops}),
            ("admission", "a namespace that is not the canary's", "create", "v1", "Namespace",
             {"body": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": f"evil-{tag}"}}}),
            ("admission", "a run namespace without Pod Security", "create", "v1", "Namespace",
             {"body": {"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": f"gpucanary-evil-{tag}", "labels": owned_labels("evil")}}}),
            ("rbac", "a Secret read", "list", "v1", "Secret", {"namespace": ops}),
            ("rbac", "a ConfigMap written", "create", "v1", "ConfigMap",
             {"namespace": own, "body": {"apiVersion": "v1", "kind": "ConfigMap",
                                         "metadata": {"name": "evil", "namespace": own}}}),
            # host access, even in its own namespace
            ("admission", "a privileged pod", "create", "v1", "Pod",
             {"namespace": own, "body": pod("p", own, container={"securityContext": {"privileged": True}})}),
            ("admission", "a hostPath pod", "create", "v1", "Pod",
             {"namespace": own, "body": pod("p", own, volumes=[{"name": "root", "hostPath": {"path": "/"}}])}),
            ("admission", "a hostNetwork pod", "create", "v1", "Pod",
             {"namespace": own, "body": pod("p", own, hostNetwork=True)}),
            ("admission", "a claim template asking for admin access to devices", "create", *RESOURCE_CLAIM_TEMPLATE,
             {"namespace": own, "body": admin_access}),
            ("admission", "a claim template in the operator's namespace", "create", *RESOURCE_CLAIM_TEMPLATE,
             {"namespace": ops, "body": {**claim_template, "metadata": {"name": "evil", "namespace": ops}}}),
            ("admission", "a NodePort Service", "create", "v1", "Service",
             {"namespace": own, "body": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "e", "namespace": own},
                                         "spec": {"type": "NodePort", "ports": [{"port": 80}]}}}),
        ]
        if cluster.nvidiadriver_mode:
            battery += [
                ("admission", "the version of an NVIDIADriver not eligible for pools", "patch", *NVIDIADRIVER,
                 {"name": "fleet", "body": {"spec": {"version": TARGET}}}),
                ("admission", "the driver image of an eligible NVIDIADriver", "patch", *NVIDIADRIVER,
                 {"name": driver, "body": {"spec": {"image": "evil"}}}),
                ("admission", "a driver pod label of an eligible NVIDIADriver", "patch", *NVIDIADRIVER,
                 {"name": driver, "body": {"spec": {"labels": {"evil": "x"}}}}),
                ("admission", "an NVIDIADriver made eligible", "patch", *NVIDIADRIVER,
                 {"name": "fleet", "body": {"metadata": {"labels": {POOL_ELIGIBLE_LABEL: "true"}}}}),
            ]
        if default is not None:
            other_image = handover_driver(default, "adversary")
            other_image["spec"]["image"] = "evil"
            wide = handover_driver(default, "adversary")
            wide["spec"]["nodeSelector"] = {"nvidia.com/gpu.present": "true"}
            battery += [
                ("admission", "a handover NVIDIADriver with another driver image", "create", *NVIDIADRIVER,
                 {"body": other_image}),
                ("admission", "a handover NVIDIADriver picking every GPU node", "create", *NVIDIADRIVER, {"body": wide}),
                ("admission", "an NVIDIADriver that is not a run's own", "create", *NVIDIADRIVER,
                 {"body": {**handover_driver(default, "adversary"), "metadata": {"name": f"evil-{tag}"}}}),
                ("admission", "the default NVIDIADriver deleted", "delete", *NVIDIADRIVER,
                 {"name": default["metadata"]["name"]}),
            ]
        let_through = [what for _, what, verb, api, kind, kw in battery if not refused(canary, verb, api, kind, **kw)]
        assert not let_through, f"the apiserver let the canary's token do: {let_through}"

        # the audit log: each refusal, and by what, as the apiserver saw it
        records = read_log(gpucanary_fleet.fleet.layout.audit_log, user_agent_prefix=USER_AGENT, since_s=since_s - 1)
        refusals = [r for r in records if r.user == USER and r.code == 403]
        assert len(refusals) == len(battery), [(r.verb, r.kind_key, r.name) for r in refusals]
        assert sum(r.authorization == "forbid" for r in refusals) == sum(who == "rbac" for who, *_ in battery)
        assert sum(r.authorization == "allow" for r in refusals) == sum(who == "admission" for who, *_ in battery)
    finally:
        for api_version, kind, name, namespace in (("v1", "Namespace", own, None),
                                                   ("nvidia.com/v1alpha1", "NVIDIADriver", driver, None),
                                                   ("apps/v1", "DaemonSet", unplaced["metadata"]["name"], ops)):
            try:
                kube.delete(api_version, kind, name, namespace=namespace)
            except NotFound:
                pass


def handover_driver(default: dict, run_id: str) -> dict:
    """The NVIDIADriver a run creates to take a node from the default one (pool/existing_node.py)."""
    spec = {k: v for k, v in default["spec"].items() if k not in ("default", "nodeSelector")}
    return {"apiVersion": NVIDIADRIVER[0], "kind": NVIDIADRIVER[1],
            "metadata": {"name": f"gpucanary-{run_id}", "labels": owned_labels(run_id)},
            "spec": {**spec, "nodeSelector": {"gpucanary.io/run-id": run_id}}}


def unplaceable_daemonset(name: str, namespace: str, node: str) -> dict:
    """A DaemonSet for one node whose pod asks for more CPU than any node has: its pod stays unbound."""
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "c", "image": "busybox:1.36", "resources": {"requests": {"cpu": "100000"}}}]}}}}


def next_unplaced_pod(kube: Kube, namespace: str, daemonset: str, timeout_s: float = 60) -> str:
    """The DaemonSet's pod, once the scheduler has said it cannot place it."""
    return kube.watch_until("v1", "Pod", lambda pods: next((name for name, p in pods.items() if unplaced(p)), None),
                            timeout_s=timeout_s, namespace=namespace, label_selector=f"app={daemonset}")
