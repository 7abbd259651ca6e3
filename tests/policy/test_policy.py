"""Parsing, validation, lint and diff of upgrade policies (pure; no cluster, no helm: Helm values
rendered by real helm are in test_policy_helm.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.policy.model import POLICY_PATHS, Drain, PodDeletion, SourceKind, UpgradePolicy, WaitForCompletion
from pytest_gpucanary.policy.parse import load_policy, parse_policy
from pytest_gpucanary.policy.diff import diff_policies
from pytest_gpucanary.policy.lint import Severity, lint_policy

POLICIES = Path(__file__).resolve().parents[2] / "fixtures" / "policies"

# Every file under fixtures/policies/ with a fragment of its one-line error, or None if it is valid.
EXPECTED = {
    "default.yaml": None,
    "operator-default.yaml": None,
    "field-note.yaml": None,
    "nvidiadriver.yaml": None,
    # checked, then handed to helm, which these pure tests do not give
    "helm-values.yaml": "is gpu-operator Helm values, which only the chart renders into a ClusterPolicy; pass "
                        "--gpucanary-helm-chart=PATH",
    "broken/missing-drain.yaml": "spec.driver.upgradePolicy.drain is missing: gpu-operator v25.10 and earlier "
                                 "panic in the upgrade controller on a nil drain",
    "broken/unknown-field.yaml": "spec.driver.upgradePolicy.maxParallel is not a known field; accepted: autoUpgrade, "
                                 "maxParallelUpgrades, maxUnavailable, waitForCompletion, podDeletion, drain",
    "broken/wrong-type.yaml": "spec.driver.upgradePolicy.drain.enable is the string 'false', not a boolean; "
                              "write true or false, without quotes",
    "broken/malformed.yaml": "is not valid YAML at line 10, column 9",
    "broken/helm-key-in-cr.yaml": "spec.driver.upgradePolicy.gpuPodDeletion is the Helm values key; a ClusterPolicy "
                                  "has no such field; rename it to podDeletion",
    "broken/auto-upgrade-off.yaml": "spec.driver.upgradePolicy.autoUpgrade is false: the upgrade controller then "
                                    "removes nvidia.com/gpu-driver-upgrade-state from every node",
    "broken/sandbox-workloads.yaml": "spec.sandboxWorkloads.enabled is true: the upgrade controller then removes",
}


def test_every_fixture_is_listed() -> None:
    on_disk = {str(p.relative_to(POLICIES)) for p in POLICIES.rglob("*.yaml")}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses_or_fails_with_its_one_line_message(name: str) -> None:
    path = POLICIES / name
    assert path.read_text().startswith("# "), "each fixture starts with a comment saying what it shows"
    expected = EXPECTED[name]
    if expected is None:
        assert load_policy(path).auto_upgrade
        return
    with pytest.raises(ConfigError) as info:
        load_policy(path)
    message = str(info.value)
    assert message.startswith(str(path))
    assert expected in message
    assert "\n" not in message


def test_cr_shapes_normalise_to_the_same_cr() -> None:
    cluster_policy = load_policy(POLICIES / "default.yaml")
    driver = load_policy(POLICIES / "nvidiadriver.yaml")
    assert cluster_policy.to_cr() == driver.to_cr()
    assert [p.source_kind for p in (cluster_policy, driver)] == ["ClusterPolicy", "NVIDIADriver"]
    assert cluster_policy.driver_version == driver.driver_version == "580.95.05"


def test_paths_follow_the_source_shape() -> None:
    helm = replace(load_policy(POLICIES / "default.yaml"), source_kind=SourceKind.HELM_VALUES)
    assert helm.path_of("podDeletion.timeoutSeconds") == "driver.upgradePolicy.gpuPodDeletion.timeoutSeconds"
    assert load_policy(POLICIES / "nvidiadriver.yaml").path_of("drain.enable") == "spec.upgradePolicy.drain.enable"


def test_lint_of_the_field_note_policy_predicts_the_non_gpu_eviction() -> None:
    findings = {f.code: f for f in lint_policy(load_policy(POLICIES / "field-note.yaml"))}
    assert findings["drain-evicts-non-gpu"].severity is Severity.ERROR
    assert findings["drain-evicts-non-gpu"].path == "spec.driver.upgradePolicy.drain.enable"
    assert "every non-DaemonSet pod on the node, GPU or not" in findings["drain-evicts-non-gpu"].message
    assert findings["emptydir-blocks-pod-deletion"].path == "spec.driver.upgradePolicy.podDeletion.deleteEmptyDir"
    assert "falls back to a full drain" in findings["emptydir-blocks-pod-deletion"].message


def test_lint_says_no_policy_frees_a_pod_that_holds_the_driver_without_a_gpu_request() -> None:
    default = {f.code: f for f in lint_policy(load_policy(POLICIES / "default.yaml"))}["driver-holders-not-freed"]
    drains = {f.code: f for f in lint_policy(load_policy(POLICIES / "field-note.yaml"))}["driver-holders-not-freed"]
    assert default.severity is Severity.INFO and "(drain is off; NVIDIA/gpu-operator #2570)" in default.message
    assert "a drain evicts them only after a GPU pod deletion failed, and never DaemonSet pods" in drains.message
    assert "--gpucanary-holder" in default.message


@pytest.mark.parametrize("name", ["default.yaml", "nvidiadriver.yaml"])
def test_the_default_policy_has_no_error_findings(name: str) -> None:
    findings = lint_policy(load_policy(POLICIES / name))
    assert [f for f in findings if f.severity is Severity.ERROR] == []
    assert "drain-evicts-non-gpu" not in {f.code for f in findings}


def _cluster_policy(policy: dict[str, Any], *, spec: dict[str, Any] | None = None) -> str:
    doc = {"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "metadata": {"name": "cluster-policy"},
           "spec": {**(spec or {}), "driver": {"upgradePolicy": policy}}}
    return yaml.safe_dump(doc)


DEFAULT_CR = load_policy(POLICIES / "default.yaml").to_cr()


def _with(path: str, value: Any) -> dict[str, Any]:
    """DEFAULT_CR with one dotted key set (or removed, for the sentinel `...`)."""
    cr = yaml.safe_load(yaml.safe_dump(DEFAULT_CR))
    *parents, last = path.split(".")
    target = cr
    for key in parents:
        target = target[key]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return cr


P = "spec.driver.upgradePolicy"


@pytest.mark.parametrize(("text", "expected"), [
    ("a: [1, 2", "x.yaml is not valid YAML at line 1"),
    ("", "x.yaml is empty (null), not a YAML mapping"),
    ("- 1\n- 2\n", "x.yaml is a list, not a YAML mapping"),
    ("apiVersion: apps/v1\nkind: Deployment\n", "kind 'Deployment' is not an upgrade policy document; give a "
                                                "ClusterPolicy (nvidia.com/v1), an NVIDIADriver"),
    ("apiVersion: nvidia.com/v1alpha1\nkind: ClusterPolicy\n", "apiVersion 'nvidia.com/v1alpha1' does not serve kind "
                                                              "ClusterPolicy; write apiVersion: nvidia.com/v1"),
    ("apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nspec: {}\n", f"{P} is missing; without it the CRD leaves "
                                                                   "autoUpgrade false"),
    ("apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nspec: 3\n", "x.yaml: spec is 3, not a mapping"),
    ("apiVersion: nvidia.com/v1alpha1\nkind: NVIDIADriver\nspec: {version: '1.2'}\n",
     "spec.upgradePolicy is missing; an NVIDIADriver carries its own policy from operator v26.7"),
    ("operator: {}\n", "driver.upgradePolicy is missing; a document without apiVersion and kind is read as "
                       "gpu-operator Helm values"),
    (_cluster_policy(_with("drain.timeoutSeconds", -5)), f"{P}.drain.timeoutSeconds is -5, below 0"),
    (_cluster_policy(_with("podDeletion.timeoutSeconds", 1.5)),
     f"{P}.podDeletion.timeoutSeconds is 1.5, not a whole number"),
    (_cluster_policy(_with("maxParallelUpgrades", True)), f"{P}.maxParallelUpgrades is True, not a whole number"),
    (_cluster_policy(_with("maxUnavailable", "101%")), f"{P}.maxUnavailable is 101%, above 100%"),
    (_cluster_policy(_with("maxUnavailable", "3")), f"{P}.maxUnavailable is the string '3', which the operator "
                                                    "rejects (neither a count nor a percentage); write 3 without "
                                                    "quotes, or 3%"),
    (_cluster_policy(_with("maxUnavailable", "quarter")), f"{P}.maxUnavailable is the string 'quarter', not a node "
                                                          "count or a percentage"),
    (_cluster_policy(_with("maxUnavailable", -1)), f"{P}.maxUnavailable is -1, below 0"),
    (_cluster_policy(_with("drain.podSelector", None)), f"{P}.drain.podSelector is empty (null), not a label "
                                                        "selector"),
    (_cluster_policy(_with("drain.evict", True)), f"{P}.drain.evict is not a known field; accepted: enable, force, "
                                                  "podSelector, timeoutSeconds, deleteEmptyDir"),
    (_cluster_policy(_with("waitForCompletion", "yes")), f"{P}.waitForCompletion is the string 'yes', not a mapping"),
    (_cluster_policy(_with("podDeletion", ...)), f"{P}.podDeletion is missing: the CRD gives it no default, so GPU "
                                                 "pod deletion fails on every reconcile"),
    (_cluster_policy(_with("drain", None)), f"{P}.drain is empty (null): gpu-operator v25.10 and earlier panic"),
    (_cluster_policy(_with("autoUpgrade", ...)), f"{P}.autoUpgrade is missing and the ClusterPolicy CRD defaults it "
                                                 "to false"),
    (_cluster_policy(_with("autoUpgrade", "true")), f"{P}.autoUpgrade is the string 'true', not a boolean"),
    (_cluster_policy(DEFAULT_CR, spec={"sandboxWorkloads": {"enabled": "no"}}),
     "spec.sandboxWorkloads.enabled is the string 'no', not a boolean"),
    ("driver:\n  version: 570.10\n  upgradePolicy: {autoUpgrade: true}\n",
     "driver.version is the number 570.1, not a version string; quote it"),
    ("driver:\n  upgradePolicy:\n    podDeletion: {force: false}\n",
     "driver.upgradePolicy.podDeletion is the CR key; the gpu-operator chart ignores it in Helm values; "
     "rename it to gpuPodDeletion"),
    ("driver:\n  upgradePolicy:\n    gpuPodDeletion:\n", "driver.upgradePolicy.gpuPodDeletion is empty (null): the "
                                                        "CRD gives it no default"),
    ("sandboxWorkloads: {enabled: true}\ndriver:\n  upgradePolicy: {autoUpgrade: true}\n",
     "x.yaml: sandboxWorkloads.enabled is true"),
])
def test_invalid_documents_fail_with_one_line_saying_where_and_what_to_do(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(text, source="x.yaml")
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert "; " in message, "a hint says what to do"


def test_kind_defaults_for_auto_upgrade() -> None:
    driver = yaml.safe_dump({"apiVersion": "nvidia.com/v1alpha1", "kind": "NVIDIADriver",
                             "spec": {"upgradePolicy": _with("autoUpgrade", ...)}})
    assert parse_policy(driver).auto_upgrade    # the NVIDIADriver CRD (v26.7) defaults it to true


def test_max_unavailable_keeps_the_form_given() -> None:
    assert parse_policy(_cluster_policy(_with("maxUnavailable", 2))).max_unavailable == 2
    assert parse_policy(_cluster_policy(_with("maxUnavailable", "100%"))).max_unavailable == "100%"


def test_diff_names_the_knobs_and_the_findings_they_bring() -> None:
    changes = {c.knob: c for c in diff_policies(load_policy(POLICIES / "default.yaml"),
                                                load_policy(POLICIES / "field-note.yaml"))}
    assert set(changes) == {"podDeletion.deleteEmptyDir", "drain.enable", "drain.deleteEmptyDir"}
    enable = changes["drain.enable"]
    assert (enable.old, enable.new, enable.path) == (False, True, f"{P}.drain.enable")
    assert "drain-evicts-non-gpu" in {f.code for f in enable.introduced}
    assert {f.code for f in changes["podDeletion.deleteEmptyDir"].introduced} == {"emptydir-blocks-pod-deletion"}
    assert {f.code for f in changes["podDeletion.deleteEmptyDir"].removed} == {"pod-deletion-loses-emptydir"}


def test_diff_of_equal_policies_is_empty() -> None:
    assert diff_policies(load_policy(POLICIES / "default.yaml"), load_policy(POLICIES / "nvidiadriver.yaml")) == []


def test_narrowing_the_drain_turns_the_error_into_a_warning() -> None:
    old = load_policy(POLICIES / "field-note.yaml")
    new = replace(old, drain=replace(old.drain, pod_selector="gpucanary.io/drainable=true"))
    [change] = diff_policies(old, new)
    assert change.knob == "drain.podSelector"
    assert [(f.code, f.severity) for f in change.introduced] == [("drain-evicts-non-gpu", Severity.WARNING)]
    assert [(f.code, f.severity) for f in change.removed] == [("drain-evicts-non-gpu", Severity.ERROR)]


selectors = st.sampled_from(["", "app=trainer", "gpucanary.io/drainable=true", "tier in (batch,train)"])
seconds = st.integers(min_value=0, max_value=10**6)
policies = st.builds(
    UpgradePolicy,
    auto_upgrade=st.just(True),
    max_parallel_upgrades=st.integers(min_value=0, max_value=64),
    max_unavailable=st.one_of(st.integers(min_value=0, max_value=1000),
                              st.integers(min_value=0, max_value=100).map(lambda n: f"{n}%")),
    wait_for_completion=st.builds(WaitForCompletion, pod_selector=selectors, timeout_s=seconds),
    pod_deletion=st.builds(PodDeletion, force=st.booleans(), timeout_s=seconds, delete_empty_dir=st.booleans()),
    drain=st.builds(Drain, enable=st.booleans(), force=st.booleans(), pod_selector=selectors, timeout_s=seconds,
                    delete_empty_dir=st.booleans()),
    source_kind=st.sampled_from(SourceKind),
    driver_version=st.one_of(st.none(), st.sampled_from(["580.95.05", "570.10", "575.57.08"])),
)


def doc_with(policy: UpgradePolicy) -> dict[str, Any]:
    """A CR of the policy's source kind carrying `policy.to_cr()` where that kind keeps it."""
    cr = policy.to_cr()
    version = {} if policy.driver_version is None else {"version": policy.driver_version}
    if policy.source_kind is SourceKind.CLUSTER_POLICY:
        return {"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
                "spec": {"driver": {**version, "upgradePolicy": cr}}}
    return {"apiVersion": "nvidia.com/v1alpha1", "kind": "NVIDIADriver", "spec": {**version, "upgradePolicy": cr}}


@settings(max_examples=200, deadline=None)
@given(policies.filter(lambda p: p.source_kind is not SourceKind.HELM_VALUES))
def test_to_cr_round_trips_through_every_cr_shape(policy: UpgradePolicy) -> None:
    assert parse_policy(yaml.safe_dump(doc_with(policy))) == policy


@settings(max_examples=200, deadline=None)
@given(policies)
def test_findings_are_one_line_and_point_into_the_source_document(policy: UpgradePolicy) -> None:
    root = ".".join(POLICY_PATHS[policy.source_kind])
    for finding in lint_policy(policy):
        assert "\n" not in finding.line()
        assert finding.path.startswith(root + ".")
        assert finding.severity in Severity


@settings(max_examples=200, deadline=None)
@given(policies, policies)
def test_every_finding_a_diff_adds_or_removes_belongs_to_exactly_one_change(old: UpgradePolicy,
                                                                           new: UpgradePolicy) -> None:
    changes = diff_policies(old, new)
    before = {(f.code, f.severity) for f in lint_policy(old)}
    after = {(f.code, f.severity) for f in lint_policy(new)}
    introduced = [(f.code, f.severity) for c in changes for f in c.introduced]
    removed = [(f.code, f.severity) for c in changes for f in c.removed]
    assert sorted(introduced) == sorted(after - before)
    assert sorted(removed) == sorted(before - after)
    assert all(c.old != c.new for c in changes)


def test_policy_modules_load_neither_kubernetes_nor_pytest() -> None:
    code = ("import sys, pytest_gpucanary.policy, pytest_gpucanary.policy.lint\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'kubernetes', 'pytest', '_pytest'}"
            " or m == 'pytest_gpucanary.kube')\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
