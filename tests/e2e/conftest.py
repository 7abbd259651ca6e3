"""End-to-end tests run on the real local fleet; each test works in a namespace of its own."""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

from pytest_gpucanary.config import REPO_ROOT
from pytest_gpucanary.kube import Conflict, Kube, NotFound


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


# --- the canary as least privilege sees it: a ServiceAccount bound to deploy/'s roles ------------------

DEPLOY_FILES = ("rbac.yaml", "local-fleet-kwok-pool.yaml")   # the fleet's kwok pools need the second


def _renamed(doc: dict, account: str) -> dict:
    """deploy/'s objects for ServiceAccount `account` (several in one session must not share roles)."""
    doc = copy.deepcopy(doc)
    if doc["kind"] != "Namespace":
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
                    continue           # the namespace, shared by every account
                if doc["kind"] != "Namespace":   # kept: deleting it races the next test's ServiceAccount
                    made.append(doc)
        token = kube.request_token(account, namespace="gpucanary", expiration_s=7200)   # a run's worst case, as the README says
        config = yaml.safe_load(gpucanary_fleet.fleet.kubeconfig.read_text())
        config["users"] = [{"name": account, "user": {"token": token}}]
        config["contexts"][0]["context"]["user"] = account
        path = tmp_path / f"{account}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    yield make
    for doc in reversed(made):
        with contextlib.suppress(NotFound):
            kube.delete(doc["apiVersion"], doc["kind"], doc["metadata"]["name"],
                        namespace=doc["metadata"].get("namespace"))


# marker -> the environment setting that runs its tests (each from its own make target)
OUTSIDE_MAKE_TEST = {"kill_matrix": "GPUCANARY_KILL_MATRIX"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The full kill matrix (hours of canary runs) runs only from `make kill-matrix`: deselected, never
    skipped."""
    held = [marker for marker, setting in OUTSIDE_MAKE_TEST.items() if os.environ.get(setting) != "1"]
    kept = [item for item in items if not any(item.get_closest_marker(marker) for marker in held)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
