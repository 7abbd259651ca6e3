"""The end-to-end tests' fixtures and the collection order of every test (a plugin of tests/conftest.py); each end-to-end
test runs on the real local fleet and works in a namespace of its own."""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml
from harness import eventually
from kubernetes.client.exceptions import ApiException

from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict, NotFound
from pytest_gpucanary.shipped import REPO_ROOT


@pytest.fixture(scope="session")
def kube(gpucanary_fleet) -> Kube:
    return Kube.connect(gpucanary_fleet.fleet.kubeconfig)


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "gpucanary-tests"}}})
    kube.wait_for("v1", "ServiceAccount", "default", lambda sa: True, namespace=name, timeout_s=30)
    yield name
    kube.delete("v1", "Namespace", name)


@pytest.fixture
def policy_before(kube: Kube) -> dict:
    """The ClusterPolicy's upgradePolicy before the test (`harness.assert_nothing_left` wants it back)."""
    return kube.get("nvidia.com/v1", "ClusterPolicy", "cluster-policy")["spec"]["driver"]["upgradePolicy"]


# --- the canary as least privilege sees it: a ServiceAccount bound to deploy/'s roles ------------------

# in the order docs/real-cluster.md applies them; the fleet's kwok pools need the last
DEPLOY_FILES = ("rbac.yaml", "rbac-clusterpolicy-mode.yaml", "admission.yaml", "local-fleet-kwok-pool.yaml")
# the admission policies match every ServiceAccount of namespace gpucanary: one set for the session, kept
ADMISSION_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def _renamed(doc: dict, account: str) -> dict:
    """deploy/'s objects for ServiceAccount `account` (several in one session must not share roles)."""
    doc = copy.deepcopy(doc)
    if doc["kind"] not in ("Namespace", *ADMISSION_KINDS):
        doc["metadata"]["name"] = doc["metadata"]["name"].replace("gpucanary", account, 1)
    if "roleRef" in doc:
        doc["roleRef"]["name"] = doc["roleRef"]["name"].replace("gpucanary", account, 1)
        for subject in doc["subjects"]:
            subject["name"] = account
    return doc


@pytest.fixture
def canary_service_account(kube: Kube, gpucanary_fleet, tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """make(account, without=(verb, resource)) -> a kubeconfig acting as ServiceAccount gpucanary/<account>,
    bound to exactly the rules in deploy/ (less the one named), with a TokenRequest token."""
    made: list[dict] = []

    def make(account: str = "gpucanary", *, without: tuple[str, str] | None = None) -> Path:
        for name in DEPLOY_FILES:
            for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / name).read_text()):
                doc = _renamed(doc, account)
                if without and doc["kind"] in ("ClusterRole", "Role"):
                    for rule in doc["rules"]:
                        if without[1] in rule["resources"]:
                            rule["verbs"] = [v for v in rule["verbs"] if v != without[0]]
                try:
                    kube.create(doc)
                except Conflict:
                    if doc["kind"] in ADMISSION_KINDS:   # the local fleet's bindings replace admission.yaml's
                        kube.patch(doc["apiVersion"], doc["kind"], doc["metadata"]["name"], {"spec": doc["spec"]})
                    continue           # the namespace, shared by every account
                if doc["kind"] not in ("Namespace", *ADMISSION_KINDS):   # kept: deleting the namespace races
                    made.append(doc)                                     # the next test's ServiceAccount
        token = kube.request_token(account, namespace="gpucanary", expiration_s=7200)   # past a run's worst case (docs/real-cluster.md)
        config = yaml.safe_load(gpucanary_fleet.fleet.kubeconfig.read_text())
        config["users"] = [{"name": account, "user": {"token": token}}]
        config["contexts"][0]["context"]["user"] = account
        path = tmp_path / f"{account}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        _wait_for_admission(Kube.connect(path))
        return path

    yield make
    for doc in reversed(made):
        with contextlib.suppress(NotFound):
            kube.delete(doc["apiVersion"], doc["kind"], doc["metadata"]["name"],
                        namespace=doc["metadata"].get("namespace"))


@pytest.fixture
def refused() -> Callable[..., bool]:
    return refused_request


def refused_request(kube: Kube, verb: str, api_version: str, kind: str, *, name: str = "", body: dict | None = None,
            namespace: str | None = None) -> bool:
    """Whether the apiserver answers 403 to the request; a write is asked as a dry run, so nothing is stored
    either way (a policy that let it through changes nothing)."""
    resource = kube.dynamic.resources.get(api_version=api_version, kind=kind)
    try:
        if verb == "create":
            resource.create(body=body, namespace=namespace, dry_run="All")
        elif verb == "patch":
            kube.dynamic.patch(resource, body=body, name=name, namespace=namespace, dry_run="All",
                               content_type="application/merge-patch+json")
        elif verb == "delete":
            resource.delete(name=name, namespace=namespace, dry_run="All")
        else:
            resource.get(name=name or None, namespace=namespace)
    except ApiException as exc:
        if exc.status == 403:
            return True
        raise
    return False


def _wait_for_admission(canary: Kube, timeout_s: float = 30) -> None:
    """The apiserver enforces a new policy or binding once its informer has it (about a second): until the
    policies refuse what they must, and the local fleet's binding lets a kwok pool's own node through."""
    foreign = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "not-the-canarys"}}
    kwok_node = {"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": "admission-probe", "labels": {"gpucanary.io/kwok-pool": "probe"}}}
    assert eventually(lambda: refused_request(canary, "create", "v1", "Namespace", body=foreign)
                      and not refused_request(canary, "create", "v1", "Node", body=kwok_node),
                      timeout_s=timeout_s, every_s=0.5), f"deploy/admission.yaml not in force after {timeout_s} s"


# marker -> the environment setting that runs its tests (each from its own make target)
OUTSIDE_MAKE_TEST = {"kill_matrix": "GPUCANARY_KILL_MATRIX", "diagnosis_matrix": "GPUCANARY_DIAGNOSIS_MATRIX",
                     "dra_variants": "GPUCANARY_DRA_VARIANTS"}


# the end-to-end modules by their summed test time in CI, longest first (minutes of canary runs, most with a fleet
# of their own), started in this order (`make test` keeps it: --no-loadscope-reorder) so that no worker is left
# with a long one at the end
LONGEST_FIRST = ("test_canary_gate.py", "test_kubelet_pool.py", "test_clusterpolicy_mode.py", "test_widen_rollout.py",
                 "test_ci_github_workflow.py", "test_policy_gate.py", "test_faults.py", "test_parallel_runs.py",
                 "test_device_rung.py", "test_operator_upgrades.py", "test_network_rung.py",
                 "test_expiring_credentials.py", "test_restart_only.py", "test_dra_cluster.py", "test_installed_package.py",
                 "test_per_driver_limits.py", "test_control_plane_faults.py", "test_canary_audit.py",
                 "test_bad_inputs.py", "test_rollout_diagnosis.py", "test_load_on_fleet.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The full kill matrix (hours of canary runs) and the diagnosis matrix run only from their make targets:
    deselected, never skipped. The longest modules go first."""
    held = [marker for marker, setting in OUTSIDE_MAKE_TEST.items() if os.environ.get(setting) != "1"]
    kept = [item for item in items if not any(item.get_closest_marker(marker) for marker in held)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items[:] = sorted(kept, key=lambda item: rank.get(item.path.name, len(rank)))
