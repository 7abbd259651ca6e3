"""deploy/ grants exactly what the run, cleanup and preflight ask for: no rule more, no rule less."""

from __future__ import annotations

import yaml

from pytest_gpucanary.config import REPO_ROOT
from pytest_gpucanary.fleet.kwok_pool import KWOK_POOL_PERMISSIONS
from pytest_gpucanary.preflight import PERMISSIONS, Permission
from pytest_gpucanary.workloads import PRIORITY_CLASS_MANIFEST


def granted(path: str) -> set[tuple[str, str, str, str, str]]:
    found = set()
    for doc in yaml.safe_load_all((REPO_ROOT / path).read_text()):
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        scope = "cluster" if doc["kind"] == "ClusterRole" else "operator"
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
    assert granted("deploy/rbac.yaml") == needed(PERMISSIONS)


def test_the_local_fleet_kwok_pool_adds_only_its_nodes_and_nvidiadrivers() -> None:
    assert granted("deploy/local-fleet-kwok-pool.yaml") == needed(KWOK_POOL_PERMISSIONS)


def test_no_rule_grants_wildcards_or_secrets() -> None:
    rules = granted("deploy/rbac.yaml") | granted("deploy/local-fleet-kwok-pool.yaml")
    assert not [r for r in rules if "*" in r or r[2] in ("secrets", "configmaps")]


def test_the_shipped_priority_class_is_the_one_the_canary_pods_name() -> None:
    shipped = yaml.safe_load((REPO_ROOT / "deploy" / "priorityclass.yaml").read_text())
    assert shipped == PRIORITY_CLASS_MANIFEST
    assert shipped["value"] < 0 and shipped["preemptionPolicy"] == "Never" and shipped["globalDefault"] is False
