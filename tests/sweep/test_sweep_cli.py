"""`gpucanary plan-sweep`, the renderers and the `gpucanary_plan_sweep` fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpucanary.sweep.model import Fleet, Node, SweepLimits, VersionSet, Workload, parse_change
from pytest_gpucanary.sweep.compare import compare_strategies
from pytest_gpucanary.sweep.plan import plan_or_infeasible
from pytest_gpucanary.sweep.report import render_html, render_json, render_table

pytest_plugins = ["pytester"]

EXAMPLE = Path(__file__).resolve().parents[2] / "fixtures" / "sweep" / "inventory.yaml"


def plan_sweep_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpucanary.cli", "plan-sweep", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPUCANARY_TRACEBACK": ""})


def test_default_output_is_a_table_of_waves_moves_and_strategies() -> None:
    result = plan_sweep_cli("--inventory", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith("sweep driver=580.95.05")
    assert any(line.split()[:3] == ["1", "0", "2"] for line in lines)  # wave 1 at 0 s, two nodes
    assert any("chat-70b-0" in line and "restore" in line for line in lines)
    for strategy in ("evict-and-restart", "wait-for-completion", "checkpoint-migrate"):
        assert any(line.startswith(strategy) for line in lines)


def test_json_goes_to_stdout_and_parses() -> None:
    result = plan_sweep_cli("--inventory", str(EXAMPLE), "--json", "--change", "model=llama-3.1-70b@2025-09")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    plan = document["plan"]
    assert plan["change"]["target"]["model"] == "llama-3.1-70b@2025-09"
    serving = [m for wave in plan["waves"] for m in wave["moves"] if m["workload"].startswith("chat-70b")]
    assert serving and all(m["kind"] == "cold-start" for m in serving)
    assert [s["strategy"] for s in document["strategies"]] == [
        "evict-and-restart", "wait-for-completion", "checkpoint-migrate"]


def test_html_page_is_offline_and_draws_the_waves(tmp_path: Path) -> None:
    page = tmp_path / "sweep.html"
    result = plan_sweep_cli("--inventory", str(EXAMPLE), "--html", str(page), "--json")
    assert result.returncode == 0, result.stderr
    text = page.read_text()
    assert "<svg" in text and "old-version GPUs left" in text and "after wave 4:" in text
    assert "src=" not in text and "href=" not in text and "<script" not in text


def test_no_plan_is_reported_as_data_and_exits_1() -> None:
    result = plan_sweep_cli("--inventory", str(EXAMPLE), "--hold-back-gpus", "8")
    assert result.returncode == 1
    assert "no plan:" in result.stdout and "fix: hold back 24 GPUs" in result.stdout
    [line] = result.stderr.splitlines()
    assert line.startswith("gpucanary: no sweep plan: wave 1: finetune-1b") and line.endswith("--hold-back-gpus 24)")


def test_no_plan_in_json_names_the_shortfall() -> None:
    result = plan_sweep_cli("--inventory", str(EXAMPLE), "--hold-back-gpus", "8", "--json")
    infeasible = json.loads(result.stdout)["infeasible"]
    assert infeasible["hold_back_fix_gpus"] == 24
    assert infeasible["shortfalls"][0]["workloads"] == ["finetune-1b"]


@pytest.mark.parametrize(("args", "says"), [
    (["--inventory", "absent.yaml"], "cannot read inventory 'absent.yaml'"),
    (["--inventory", str(EXAMPLE), "--change", "kernel=6.8"], "unknown component 'kernel'"),
    (["--inventory", str(EXAMPLE), "--max-parallel", "two"], "--max-parallel 'two' is not a whole number"),
    (["--inventory", str(EXAMPLE), "--max-unavailable", "0"], "lets no node upgrade"),
    ([], "plan-sweep needs --inventory PATH"),
])
def test_bad_input_is_one_line_and_exit_4(args: list[str], says: str) -> None:
    result = plan_sweep_cli(*args)
    assert result.returncode == 4
    [line] = result.stderr.splitlines()
    assert line.startswith("gpucanary: error: ") and says in line
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_malformed_yaml_is_one_line_and_exit_4(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes:\n  - {name: a, gpus: [\n")
    result = plan_sweep_cli("--inventory", str(broken))
    assert result.returncode == 4 and len(result.stderr.splitlines()) == 1
    assert "is not valid YAML" in result.stderr and "Traceback" not in result.stderr


def test_renderers_escape_names_in_html() -> None:
    versions = VersionSet(driver="570")
    fleet = Fleet((Node("<b>n1</b>", "H100", 8, versions), Node("n2", "H100", 8, versions)),
                  (Workload("w&1", "<b>n1</b>", 2),))
    change, limits = parse_change(["driver=580"]), SweepLimits(1, "1", 0)
    outcome = plan_or_infeasible(fleet, change, limits)
    costs = compare_strategies(fleet, change, limits, outcome=outcome)
    page = render_html(outcome, costs)
    assert "<b>n1</b>" not in page and "&lt;b&gt;n1&lt;/b&gt;" in page
    assert "w&1" in render_table(outcome, costs) and json.loads(render_json(outcome, costs))["plan"]["cold_starts"] == 1


def test_fixture_plans_from_a_path_a_dict_and_expects_no_plan(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(f"""
        import pytest
        from pytest_gpucanary.sweep.model import NoSweepPlanError

        EXAMPLE = {str(EXAMPLE)!r}

        def test_from_path(gpucanary_plan_sweep):
            plan = gpucanary_plan_sweep(EXAMPLE)
            assert plan.cold_starts == 7

        def test_from_dict_with_change_and_limits(gpucanary_plan_sweep):
            inventory = {{"nodes": [{{"name": "a", "gpu_model": "H100", "gpus": 8, "versions": {{"driver": "570"}}}},
                                   {{"name": "b", "gpu_model": "H100", "gpus": 8, "versions": {{"driver": "570"}}}}],
                         "workloads": [{{"name": "w", "node": "a", "gpus": 2, "checkpoint": {{"driver": "570"}}}}]}}
            plan = gpucanary_plan_sweep(inventory, change="driver=580", limits={{"hold_back_gpus": 8}})
            # empty b drains first; a is held back, so w crosses once, onto the upgraded b
            assert [(m.kind.value, m.to_node) for wave in plan.waves for m in wave.moves] == [("cold-start", "b")]

        def test_expects_no_plan(gpucanary_plan_sweep):
            with pytest.raises(NoSweepPlanError, match="hold back 24 GPUs"):
                gpucanary_plan_sweep(EXAMPLE, limits={{"max_parallel": 2, "hold_back_gpus": 8}})
    """)
    result = pytester.runpytest_subprocess("-p", "pytest_gpucanary.sweep.fixtures", "-p", "no:locust")
    result.assert_outcomes(passed=3)


def test_fixture_fails_bad_input_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        def test_bad_change(gpucanary_plan_sweep):
            gpucanary_plan_sweep({"nodes": []}, change="kernel=6.8")
    """)
    result = pytester.runpytest_subprocess("-p", "pytest_gpucanary.sweep.fixtures", "-p", "no:locust")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*gpucanary_plan_sweep: unknown component 'kernel' in change 'kernel=6.8'*"])
    assert "Traceback" not in result.stdout.str()
