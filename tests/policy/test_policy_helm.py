"""Helm values through real Helm: the pick-out and the chart notes (pure), then `helm template` of the
real gpu-operator v26.7.0 chart with the helm that ci/build-helm.sh builds (each render well under 1 s)."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pytest_gpucanary.errors import ConfigError, EnvError
from pytest_gpucanary.fleet.binaries import operator_chart
from pytest_gpucanary.policy.helm import HelmChart
from pytest_gpucanary.policy.diff import diff_policies, render_lines
from pytest_gpucanary.policy.lint import Severity, lint_policy
from pytest_gpucanary.policy.model import SourceKind
from pytest_gpucanary.policy.parse import load_policy, parse_policy
from pytest_gpucanary.policy.render import ChartNote, Rendered, chart_notes, pick_cluster_policy

REPO_ROOT = Path(__file__).resolve().parents[2]
POLICIES = REPO_ROOT / "fixtures" / "policies"
RELEASE = "v26.7.0"


# --- pure: pick-out and notes ----------------------------------------------------------------------

def _manifests(*docs: dict) -> Rendered:
    return Rendered("chart/", "---\n# Source: x\n" + "---\n".join(yaml.safe_dump(d) for d in docs))


CLUSTER_POLICY = {"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "metadata": {"name": "cluster-policy"},
                  "spec": {"driver": {"upgradePolicy": {"autoUpgrade": True}}}}


def test_the_cluster_policy_is_picked_out_of_every_rendered_document() -> None:
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    older = {**CLUSTER_POLICY, "apiVersion": "nvidia.com/v1alpha1"}     # same kind, another API: not ours
    assert pick_cluster_policy(_manifests(other, older, CLUSTER_POLICY), source="v.yaml") == CLUSTER_POLICY


@pytest.mark.parametrize(("docs", "expected"), [
    ((), "v.yaml: helm template of chart/ rendered no ClusterPolicy (nvidia.com/v1); it rendered nothing"),
    (({"apiVersion": "v1", "kind": "ConfigMap"},), "rendered no ClusterPolicy (nvidia.com/v1); it rendered ConfigMap"),
    ((CLUSTER_POLICY, CLUSTER_POLICY), "rendered 2 ClusterPolicies"),
])
def test_no_single_cluster_policy_is_one_line_naming_the_chart(docs: tuple, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        pick_cluster_policy(_manifests(*docs), source="v.yaml")
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_notes_name_each_knob_left_to_the_chart_or_changed_by_it() -> None:
    notes = chart_notes({"maxUnavailable": 0, "drain.force": False},
                        {"maxUnavailable": "25%", "drain.enable": False, "drain.force": False},
                        path_of=lambda knob: f"driver.upgradePolicy.{knob}")
    assert [n.line() for n in notes] == [
        'driver.upgradePolicy.maxUnavailable: 0 in values -> "25%" (the chart\'s template)',
        "driver.upgradePolicy.drain.enable: not in values -> false (chart default)"]
    assert notes[1] == ChartNote("drain.enable", "driver.upgradePolicy.drain.enable", False)


def test_values_are_checked_before_anything_renders() -> None:
    class Refuses:
        def render(self, values_text: str, *, source: str) -> Rendered:
            raise AssertionError("a bad values file must not reach helm")

    with pytest.raises(ConfigError, match="drain.enable is the string 'no', not a boolean"):
        parse_policy("driver:\n  upgradePolicy:\n    drain: {enable: 'no'}\n", helm=Refuses())


# --- real helm, real chart --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm_binary() -> Path:
    result = subprocess.run(["bash", str(REPO_ROOT / "ci" / "build-helm.sh")], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


@pytest.fixture(scope="module")
def chart() -> Path:
    return operator_chart(RELEASE, lambda line: None)


@pytest.fixture(scope="module")
def helm(helm_binary: Path, chart: Path) -> HelmChart:
    return HelmChart(chart=chart, binary=helm_binary)


def test_the_example_values_render_to_the_charts_cluster_policy(helm: HelmChart, chart: Path) -> None:
    policy = load_policy(POLICIES / "helm-values.yaml", helm=helm)
    assert policy.to_cr() == {
        "autoUpgrade": True, "maxParallelUpgrades": 1, "maxUnavailable": "25%",
        "waitForCompletion": {"podSelector": "", "timeoutSeconds": 0},
        "podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": True},
        "drain": {"enable": False, "force": False, "podSelector": "", "timeoutSeconds": 300, "deleteEmptyDir": False},
    }
    assert policy.source_kind is SourceKind.HELM_VALUES
    assert policy.driver_version == "580.95.05"
    assert policy.rendering is not None and policy.rendering.chart == str(chart)
    lines = [n.line() for n in policy.rendering.notes]
    assert "driver.upgradePolicy.drain.force: not in values -> false (chart default)" in lines
    assert "driver.upgradePolicy.gpuPodDeletion.timeoutSeconds: not in values -> 300 (chart default)" in lines
    assert not any(n.knob in ("autoUpgrade", "drain.enable", "podDeletion.deleteEmptyDir") for n in policy.rendering.notes)


def test_the_rendered_cr_and_its_values_file_are_the_same_canary_run(helm: HelmChart, tmp_path: Path) -> None:
    """What the canary applies for the values file is exactly what it applies for the CR Helm renders."""
    values = (POLICIES / "helm-values.yaml").read_text()
    rendered = pick_cluster_policy(helm.render(values, source="helm-values.yaml"), source="helm-values.yaml")
    cr_file = tmp_path / "rendered-cluster-policy.yaml"
    cr_file.write_text(yaml.safe_dump(dict(rendered)))
    from_cr = load_policy(cr_file)
    from_values = load_policy(POLICIES / "helm-values.yaml", helm=helm)
    assert from_cr.source_kind is SourceKind.CLUSTER_POLICY
    assert replace(from_values, source_kind=SourceKind.CLUSTER_POLICY, rendering=None) == from_cr
    assert from_values.to_cr() == load_policy(POLICIES / "default.yaml").to_cr()
    assert diff_policies(load_policy(POLICIES / "default.yaml"), from_values) == []


def test_values_that_say_nothing_get_the_charts_whole_policy(helm: HelmChart) -> None:
    policy = parse_policy("driver:\n  upgradePolicy: {}\n", source="v.yaml", helm=helm)
    assert policy.auto_upgrade            # the chart's values.yaml says true; the ClusterPolicy CRD would say false
    assert policy.rendering is not None
    assert {n.knob for n in policy.rendering.notes} == set(policy.knobs())
    assert all(not n.in_values for n in policy.rendering.notes)


def test_the_template_turns_max_unavailable_zero_into_25_percent(helm: HelmChart) -> None:
    """The chart writes `maxUnavailable | default "25%"`, and Helm's default treats 0 as empty."""
    policy = parse_policy("driver:\n  upgradePolicy:\n    maxUnavailable: 0\n", source="v.yaml", helm=helm)
    assert policy.max_unavailable == "25%"
    assert policy.rendering is not None
    [note] = [n for n in policy.rendering.notes if n.knob == "maxUnavailable"]
    assert note.line() == 'driver.upgradePolicy.maxUnavailable: 0 in values -> "25%" (the chart\'s template)'
    assert "max-unavailable-zero" not in {f.code for f in lint_policy(policy)}


def test_a_key_the_template_renders_unquoted_is_judged_as_rendered(helm: HelmChart) -> None:
    """The chart writes `podSelector: {{ ... }}` without quoting, so the selector "true" becomes a boolean."""
    with pytest.raises(ConfigError) as info:
        parse_policy('driver:\n  upgradePolicy:\n    drain: {podSelector: "true"}\n', source="v.yaml", helm=helm)
    assert str(info.value).startswith("v.yaml as rendered by helm: spec.driver.upgradePolicy.drain.podSelector "
                                      "is True, not a label selector")


def test_lint_lines_show_the_rendered_policy_then_the_chart_notes(helm: HelmChart) -> None:
    policy = load_policy(POLICIES / "helm-values.yaml", helm=helm)
    lines = render_lines(lint_policy(policy), policy=policy).splitlines()
    assert lines[0].startswith("rendered by helm template from chart ")
    assert lines[0].endswith('"drain": {"enable": false, "force": false, "podSelector": "", "timeoutSeconds": 300, '
                             '"deleteEmptyDir": false}}')
    assert "chart driver.upgradePolicy.drain.force: not in values -> false (chart default)" in lines
    assert [f for f in lint_policy(policy) if f.severity is Severity.ERROR] == []


def test_a_template_failure_is_one_line_with_helms_first_error(helm_binary: Path, tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: broken\nversion: 0.1.0\n")
    (tmp_path / "templates" / "cp.yaml").write_text('{{ fail "no driver section" }}\n')
    with pytest.raises(ConfigError) as info:
        load_policy(POLICIES / "helm-values.yaml", helm=HelmChart(chart=tmp_path, binary=helm_binary))
    message = str(info.value)
    assert f"helm-values.yaml: helm template of {tmp_path} failed: Error: execution error at " in message
    assert "no driver section" in message and "\n" not in message


def test_a_chart_without_a_cluster_policy_is_refused(helm_binary: Path, tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: other\nversion: 0.1.0\n")
    (tmp_path / "templates" / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(ConfigError, match="rendered no ClusterPolicy .* it rendered ConfigMap; give the gpu-operator"):
        load_policy(POLICIES / "helm-values.yaml", helm=HelmChart(chart=tmp_path, binary=helm_binary))


@pytest.mark.parametrize(("helm", "kind", "expected"), [
    (HelmChart(), ConfigError, "gpu-operator Helm values need the chart that renders them; pass "
                               "--gpucanary-helm-chart=PATH"),
    (HelmChart(chart=Path("/nonexistent/gpu-operator")), ConfigError,
     "--gpucanary-helm-chart='/nonexistent/gpu-operator' does not exist"),
    (HelmChart(chart=POLICIES), ConfigError, "is neither a chart directory (with Chart.yaml) nor a .tgz"),
    (HelmChart(chart=POLICIES / "default.yaml"), ConfigError, "is neither a chart directory"),
])
def test_a_missing_chart_is_one_line_saying_which_option(helm: HelmChart, kind: type, expected: str) -> None:
    with pytest.raises(kind) as info:
        load_policy(POLICIES / "helm-values.yaml", helm=helm)
    assert expected in str(info.value)


def test_a_helm_binary_that_is_not_there_is_refused(chart: Path) -> None:
    with pytest.raises(ConfigError, match="--gpucanary-helm-binary='/nonexistent/helm' is not an executable file"):
        load_policy(POLICIES / "helm-values.yaml", helm=HelmChart(chart=chart, binary=Path("/nonexistent/helm")))


def test_no_helm_anywhere_is_an_environment_error(chart: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpucanary.policy import helm as helm_module

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(helm_module, "BUILD_SCRIPT", Path("/nonexistent/build-helm.sh"))
    with pytest.raises(EnvError, match="helm is not on PATH and cannot be built here"):
        load_policy(POLICIES / "helm-values.yaml", helm=HelmChart(chart=chart))


def test_a_packaged_chart_renders_the_same(helm: HelmChart, helm_binary: Path, chart: Path, tmp_path: Path) -> None:
    subprocess.run([str(helm_binary), "package", str(chart), "-d", str(tmp_path)], check=True, capture_output=True,
                   timeout=60)
    [tgz] = tmp_path.glob("*.tgz")
    packaged = load_policy(POLICIES / "helm-values.yaml", helm=HelmChart(chart=tgz, binary=helm_binary))
    assert packaged.to_cr() == load_policy(POLICIES / "helm-values.yaml", helm=helm).to_cr()
