"""What the canary asks of the apiserver, proven from the fleet's audit log.

Every request of the canary carries the user agent gpucanary/<version>; the fleet's apiserver logs
every request at level Metadata. One full run may write only to its pool nodes, its namespace
gpucanary-<run-id>, the objects it created, the policy objects it patches and restores, and its verdict
ConfigMap in the canary's namespace; a refused bad input makes no request at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpucanary.cluster import discover
from testbed.audit import Scope, outside
from testbed.audit_run import run_canary
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.shipped import FIXTURES
from harness import FAST, TARGET

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLICY = f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}"


def describe(records) -> str:
    return "\n".join(f"{r.verb} {r.request_uri} -> {r.code}" for r in records[:20])


def test_a_full_run_writes_only_to_its_pool_namespace_own_objects_and_the_policy(gpucanary_fleet, kube: Kube,
                                                                                  tmp_path: Path) -> None:
    result = run_canary(gpucanary_fleet.fleet, [POLICY, f"--gpucanary-driver-version={TARGET}", *FAST],
                        reports=tmp_path / "reports")
    assert result.returncode == 0, result.output[-3000:]
    scope = result.scope()
    writes = [r for r in result.records if r.is_write]
    assert scope.pool_nodes and writes, "the run must have made writes and named its pool"
    by_scope = {r.audit_id: scope.scope_of(r) for r in writes}
    # its verdict is a create, or (an earlier run of the same key on this fleet) a 409 and a patch of that one
    assert not (wrote_outside := outside(result.records, scope)), describe(wrote_outside)
    # the run did the writes it exists for: its namespace, its pool node, and the policy it restored: on the
    # pool's own NVIDIADriver where the operator reads it there (v26.7+), else on the ClusterPolicy
    touched = set(by_scope.values())
    per_driver = discover(kube).per_driver_policy
    assert {Scope.OWN_NAMESPACE, Scope.POOL_NODE, Scope.OWN_OBJECT if per_driver else Scope.POLICY} <= touched, touched
    if per_driver:
        assert Scope.POLICY not in touched, describe([r for r in writes if by_scope[r.audit_id] == Scope.POLICY])
        driver_writes = [r for r in writes if r.resource == "nvidiadrivers" and r.verb == "patch"]
        assert driver_writes and {r.name for r in driver_writes} <= {n.rsplit("-", 1)[0] for n in scope.pool_nodes}
    created_nodes = {r.name for r in writes if r.resource == "nodes" and r.verb == "create"}
    assert created_nodes == scope.pool_nodes
    policy_writes = [r for r in writes if by_scope[r.audit_id] == Scope.POLICY]
    assert {r.name for r in policy_writes} <= {"cluster-policy"}, describe(policy_writes)
    # the log really is the canary's: it saw our user agent on the object it created first
    assert any(r.resource == "namespaces" and r.verb == "create" and r.name == scope.namespace for r in writes)


@pytest.mark.parametrize("bad", [
    pytest.param(["--gpucanary-policy={broken}", f"--gpucanary-driver-version={TARGET}"], id="malformed-policy"),
    pytest.param([POLICY, f"--gpucanary-driver-version={TARGET}", "--gpucanary-pool-size=0"], id="pool-size-0"),
])
def test_refused_bad_input_makes_no_request(gpucanary_fleet, tmp_path: Path, bad: list[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nspec:\n  driver: [unclosed\n")
    result = run_canary(gpucanary_fleet.fleet, [arg.format(broken=broken) for arg in bad],
                        reports=tmp_path / "reports", timeout_s=120)
    assert result.returncode == 4, result.output[-2000:]
    assert "Traceback" not in result.output
    assert result.records == [], describe(result.records)
