"""The gate's comparison rules and its receipt, on the ladder's canned runs; its inputs, offline."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from canned_runs import clean_run, field_note_run  # canned runs, shared

from pytest_gpucanary import cli, ladder
from pytest_gpucanary.command import ExitCode
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.ladder import Outcome, PhaseStats, RunEvidence, Stage, StageVerdict
from pytest_gpucanary.policy.diff import diff_policies
from pytest_gpucanary.policy.lint import lint_policy
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.premerge.compare import Side, compare, eviction_diff, workload_of
from pytest_gpucanary.premerge.gate import check_run_args, plan, read_source
from pytest_gpucanary.premerge.receipt import render_gate_html, render_gate_json, render_gate_markdown
from pytest_gpucanary.receipt.html import timeline_svg
from pytest_gpucanary.shipped import FIXTURES

PHASES = ("before", "drain", "restart", "after")


def side(label: str, evidence: RunEvidence, settings: Settings = Settings()) -> Side:
    return Side(label, evidence, ladder.evaluate(evidence, settings))


def phases(**failed: int) -> tuple[PhaseStats, ...]:
    return tuple(PhaseStats(p, 200, failed.get(p, 0), 0.01, 0.05, 0.1) for p in PHASES)


def rules(comparison) -> list[str]:
    return [r.rule for r in comparison.regressions]


def test_field_note_head_fails_naming_the_stage_and_the_non_gpu_eviction_it_adds() -> None:
    comparison = compare(side("base", clean_run()), side("head", field_note_run()))
    assert not comparison.gate_passed
    assert "stage" in rules(comparison) and "evictions" in rules(comparison)
    [stage] = [r.line for r in comparison.regressions if r.rule == "stage"]
    assert stage.startswith("application passed on base, fail on head: application: non-GPU pod default/sched-api")
    [added] = [r.line for r in comparison.regressions if r.rule == "evictions"]
    assert "one more non-GPU pod, not allowed than base (1 vs 0)" in added
    assert "non-GPU pod default/sched-api-7f9c evicted by drain at +212s" in added
    assert comparison.headline().startswith("Gate FAILED: head fails at stage application")


def test_the_reverse_change_passes_with_no_regression() -> None:
    comparison = compare(side("base", field_note_run()), side("head", clean_run()))
    assert comparison.gate_passed and comparison.regressions == ()


def test_a_run_against_itself_passes() -> None:
    comparison = compare(side("base", clean_run()), side("head", clean_run()))
    assert comparison.gate_passed and comparison.regressions == ()


def test_head_failing_the_ladder_fails_the_gate_even_when_base_failed_the_same_way() -> None:
    comparison = compare(side("base", field_note_run()), side("head", field_note_run()))
    assert comparison.regressions == () and not comparison.gate_passed
    assert comparison.headline().startswith("Gate FAILED: head fails at stage application; 0 regression(s)")


def test_a_stage_inconclusive_on_head_where_base_passed_is_a_regression() -> None:
    base = side("base", clean_run())
    head = side("head", clean_run(probes=()))        # no probes: the scheduler cannot be judged
    assert head.result.verdict(Stage.SCHEDULER).outcome is Outcome.INCONCLUSIVE
    assert [r.line.split(":")[0] for r in compare(base, head).regressions] == [
        "scheduler passed on base, inconclusive on head"]


def test_only_a_stage_that_passed_on_base_can_regress() -> None:
    base = side("base", clean_run())
    assert base.result.verdict(Stage.NETWORK).outcome is Outcome.SKIPPED      # one-node pool
    failed_network = tuple(StageVerdict(v.stage, Outcome.FAIL, "network: down") if v.stage is Stage.NETWORK else v
                           for v in base.result.verdicts)
    head = Side("head", base.evidence, dataclasses.replace(base.result, verdicts=failed_network))
    assert compare(base, head).regressions == ()


def test_more_evictions_of_a_kind_is_a_regression_and_the_same_count_is_not() -> None:
    base, head = side("base", clean_run()), side("head", clean_run())
    assert len(base.result.evictions) == 1 and not eviction_diff(base, head)[1]
    noisy = side("head", field_note_run())
    only_base, only_head = eviction_diff(base, noisy)
    assert [workload_of(e) for e in only_head] == ["sched-api-7f9c"] and only_base == []


def test_workload_names_drop_the_run_specific_pod_suffixes() -> None:
    from pytest_gpucanary.ladder.model import Eviction

    def named(name: str) -> Eviction:
        return Eviction("n", "ns", name, 0, "", True, False, 0, 0.0, "GPU pods only")

    assert workload_of(named("sched-api-6d9f8b7c4d-x2k9p")) == "sched-api"
    assert workload_of(named("gpu-train-q7w2z")) == "gpu-train"


def test_a_service_phase_over_its_slo_on_head_only_is_a_regression() -> None:
    base = side("base", clean_run(service_phases=phases()))
    head = side("head", clean_run(service_phases=phases(drain=30)))
    [regression] = [r for r in compare(base, head).regressions if r.rule == "service"]
    assert regression.line == ("service phase drain over its SLO on head, within it on base: error ratio 0.150 "
                               "(30/200) > 0.01 (load generator clock)")
    both = side("base", clean_run(service_phases=phases(drain=30)))
    assert "service" not in rules(compare(both, head))


def test_an_upgrade_over_its_budget_on_head_only_is_a_regression() -> None:
    tight = Settings(upgrade_budget_s=200)
    base, head = side("base", clean_run(), tight), side("head", field_note_run(), tight)
    assert base.upgrade_s() == pytest.approx(135) and head.upgrade_s() == pytest.approx(335)
    [regression] = [r for r in compare(base, head).regressions if r.rule == "upgrade"]
    assert regression.line == "upgrade took 335 s on head > budget 200 s (base: 135 s; client receive time)"
    assert "upgrade" not in rules(compare(head, head))


def receipts() -> tuple[str, str, str]:
    comparison = compare(side("base", clean_run(run_id="r-base", service_phases=phases())),
                         side("head", field_note_run(run_id="r-head", service_phases=phases(drain=30))))
    old, new = (load_policy(FIXTURES / "policies" / f"{n}.yaml") for n in ("default", "field-note"))
    changes, findings = diff_policies(old, new), lint_policy(new)
    return tuple(render(comparison, changes, findings)
                 for render in (render_gate_markdown, render_gate_json, render_gate_html))


def test_markdown_receipt_shows_stages_evictions_phases_upgrade_time_and_knob_changes() -> None:
    markdown, _, _ = receipts()
    assert markdown.startswith("# gpucanary gate: Gate FAILED: head fails at stage application")
    assert "| stage application | pass | fail |" in markdown
    assert "| evictions | 1 | 2 |" in markdown
    assert "| service drain | 0/200 failed, p99 0.100 s | 30/200 failed, p99 0.100 s |" in markdown
    assert "| upgrade time (to upgrade-done) | 135 s | 335 s |" in markdown
    assert "- head only: non-GPU pod default/sched-api-7f9c evicted by drain at +212s" in markdown
    assert "- `spec.driver.upgradePolicy.drain.enable: false -> true`" in markdown
    assert "  - adds error drain-evicts-non-gpu" in markdown


def test_json_receipt_carries_the_verdict_and_both_sides() -> None:
    _, text, _ = receipts()
    document = json.loads(text)
    assert document["gate_passed"] is False and document["schema"] == "gpucanary-gate-receipt/1"
    assert {r["rule"] for r in document["regressions"]} == {"stage", "evictions", "service"}
    assert document["base"]["run_id"] == "r-base" and document["head"]["upgrade_s"] == pytest.approx(335)
    assert {"stage": "application", "base": "pass", "head": "fail"} in document["stages"]
    assert any(c["knob"] == "drain.enable" and c["introduced"] for c in document["changes"])


def test_html_receipt_draws_both_timelines_on_one_scale() -> None:
    _, _, page = receipts()
    svgs = re.findall(r'<svg [^>]*aria-label="upgrade timeline (base|head)".*?</svg>', page, flags=re.S)
    assert svgs == ["base", "head"]
    ticks = [re.findall(r">([+-]\d+s)</text>", svg) for svg in
             re.findall(r'<svg [^>]*aria-label="upgrade timeline (?:base|head)".*?</svg>', page, flags=re.S)]
    alone = re.findall(r">([+-]\d+s)</text>", timeline_svg(*astuple_side(clean_run())))
    assert ticks[0] == ticks[1] and "+600s" in ticks[0] and "+600s" not in alone   # head's longer run sets both


def astuple_side(evidence: RunEvidence) -> tuple:
    return ladder.evaluate(evidence), evidence


def git_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "gpu-operator").mkdir(parents=True)
    (repo / "gpu-operator" / "upgrade-policy.yaml").write_text((FIXTURES / "policies" / "default.yaml").read_text())
    for command in (["init", "-q", "-b", "main"], ["add", "."],
                    ["-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "policy"]):
        subprocess.run(["git", *command], cwd=repo, check=True)
    return repo


def test_a_git_source_is_read_with_git_show_and_a_bad_ref_is_a_config_error(tmp_path: Path) -> None:
    repo = git_repo(tmp_path)
    path = read_source("git:main:gpu-operator/upgrade-policy.yaml", into=tmp_path / "out", label="base", repo=repo)
    assert path.read_text() == (FIXTURES / "policies" / "default.yaml").read_text()
    with pytest.raises(ConfigError, match=r"cannot read 'git:nosuch:gpu-operator/upgrade-policy.yaml': fatal: "):
        read_source("git:nosuch:gpu-operator/upgrade-policy.yaml", into=tmp_path / "out", label="base", repo=repo)
    with pytest.raises(ConfigError, match="is not git:REF:PATH"):
        read_source("git:main", into=tmp_path / "out", label="base", repo=repo)


def test_a_git_source_never_passes_an_option_to_git(tmp_path: Path) -> None:
    repo = git_repo(tmp_path)
    written = tmp_path / "written-by-git"
    for source in (f"git:--output={written}:x", f"git:-o{written}:x"):
        with pytest.raises(ConfigError, match="is not git:REF:PATH"):
            read_source(source, into=tmp_path / "out", label="base", repo=repo)
    # a revision that only looks like an option after the first character is still read as a revision
    with pytest.raises(ConfigError, match="cannot read"):
        read_source(f"git:main^{{/--output={written}}}:x", into=tmp_path / "out", label="base", repo=repo)
    assert not written.exists()


def test_the_gate_names_each_run_itself() -> None:
    with pytest.raises(ConfigError, match="gate sets --gpucanary-policy for each run itself"):
        check_run_args(["--gpucanary-policy=x.yaml"])
    check_run_args(["--gpucanary-driver-version=580.95.05", "--gpucanary-reports-dir=r", "--gpucanary-run-id=x"])


def test_a_gate_id_too_long_for_its_run_ids_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gives run ids such as"):
        plan(base="a.yaml", head="b.yaml", run_args=[], reports_dir=tmp_path, gate_id="g" * 36)


def test_plan_reads_and_diffs_both_policies_before_any_cluster(tmp_path: Path) -> None:
    planned = plan(base=str(FIXTURES / "policies" / "default.yaml"), head=str(FIXTURES / "policies" / "field-note.yaml"),
                   run_args=[], reports_dir=tmp_path, gate_id="g1")
    assert [s.run_id for s in planned.specs] == ["g1-base", "g1-head"] and planned.gate_dir == tmp_path / "gate-g1"
    assert "drain.enable" in [c.knob for c in planned.changes]


def test_cli_bad_ref_is_one_line_and_exit_4_before_any_cluster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(git_repo(tmp_path))
    monkeypatch.setenv("GPUCANARY_FLEET_DIR", str(tmp_path / "no-fleet"))   # a fleet start would show here
    code = cli.main(["gate", "--base", "git:nosuch:gpu-operator/upgrade-policy.yaml",
                     "--head", "gpu-operator/upgrade-policy.yaml", "--gpucanary-driver-version=580.95.05"])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE
    assert err.count("\n") == 1 and err.startswith("gpucanary: error: cannot read 'git:nosuch:")
    assert "Traceback" not in err and not (tmp_path / "no-fleet").exists()
