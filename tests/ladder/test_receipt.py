"""Launch receipts rendered from ladder results of canned runs: JSON, Markdown, HTML, JUnit, files."""

from __future__ import annotations

import dataclasses
import html
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from canned_runs import NEW, OLD, at, clean_run, field_note_run, probes  # canned runs, shared

from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.ladder import LadderResult, PhaseStats, RunEvidence, Stage, WorkloadRef, evaluate
from pytest_gpucanary.canary.metrics import MetricsError, query
from pytest_gpucanary.progress import ProgressLine
from pytest_gpucanary.receipt import write_receipt
from pytest_gpucanary.receipt.ci import ci_identity
from pytest_gpucanary.receipt.html import render_html
from pytest_gpucanary.receipt.json import parse_json, render_json
from pytest_gpucanary.receipt.junit import render_stage_junit
from pytest_gpucanary.receipt.markdown import render_markdown
from pytest_gpucanary.safe_text import redact_url


def with_identity(evidence: RunEvidence) -> RunEvidence:
    return dataclasses.replace(evidence, run_id="r-7f3a", policy_path="policies/drain-fallback.yaml",
                               gpu_job=WorkloadRef("default", "train", "5d1c-uid"), finished_wall_ns=at(600))


def judged(evidence: RunEvidence, settings: Settings = Settings()) -> tuple[LadderResult, RunEvidence]:
    evidence = with_identity(evidence)
    return evaluate(evidence, settings), evidence


def junit_cases(xml_text: str) -> dict[str, ET.Element]:
    return {case.get("name"): case for case in ET.fromstring(xml_text).iter("testcase")}


def test_json_round_trips() -> None:
    result, evidence = judged(field_note_run(), Settings(max_p99_s=2.0))
    assert parse_json(render_json(result, evidence)) == result
    assert result.evictions and result.phase_windows and result.state_spans


def test_every_receipt_shows_the_gpu_dip_and_when_the_gpus_came_back() -> None:
    result, evidence = judged(clean_run())
    line = "canary-0: GPUs left allocatable at +26.0s (8 -> 0), back at +130.0s: gone 104.0 s"
    [capacity] = json.loads(render_json(result, evidence))["capacity"]
    assert (capacity["left_s"], capacity["back_s"], capacity["gone_s"]) == (26.0, 130.0, 104.0)
    assert f"- {line}" in render_markdown(result, evidence)
    page = render_html(result, evidence)
    assert "canary-0 GPUs" in page and "allocatable 0..8; gone 104 s" in page and html.escape(line) in page


def test_evidence_round_trips_without_its_records(tmp_path: Path) -> None:
    phases = tuple(PhaseStats(p, 900, 9, 0.02, 0.05, 0.2) for p in ("before", "drain", "restart", "after"))
    _, evidence = judged(field_note_run(service_phases=phases))
    assert RunEvidence.from_json(evidence.to_json(), evidence.records) == evidence
    (tmp_path / "timeline.jsonl").write_text("".join(r.to_json() + "\n" for r in evidence.records))
    evidence.write(tmp_path)
    assert RunEvidence.read(tmp_path) == evidence


def test_json_names_the_gate_and_the_first_failed_stage() -> None:
    document = json.loads(render_json(*judged(field_note_run())))
    assert (document["gate_passed"], document["first_failed"]) == (False, "application")
    application = next(v for v in document["verdicts"] if v["stage"] == "application")
    assert application["summary"].startswith("application: non-GPU pod default/sched-api-7f9c evicted by drain")
    assert document["run"]["started_utc"].endswith("+00:00")


def test_html_is_one_offline_page_with_the_timeline_and_the_failed_stage() -> None:
    evidence = field_note_run(service_phases=tuple(PhaseStats(p, 900, 9, 0.02, 0.05, 0.2)
                                                   for p in ("before", "drain", "restart", "after")))
    result, evidence = judged(evidence)
    page = render_html(result, evidence)
    assert "<svg" in page and "</svg>" in page
    assert "Gate FAILED at stage application" in page
    assert "sched-api-7f9c +212s" in page and "#c62828" in page          # the red eviction marker, labelled
    assert "drain-required" in page and "service load" in page
    assert "<script" not in page and "src=" not in page and "<link" not in page


def test_html_of_a_clean_run_without_records_still_renders() -> None:
    evidence = dataclasses.replace(clean_run(probes=probes(1)), records=())
    result, evidence = judged(evidence)
    page = render_html(result, evidence)
    assert "<svg" in page and "no Node records" in page and "Gate FAILED at stage rollout" in page


def test_junit_has_one_case_per_stage_with_failure_text_and_skip_reason() -> None:
    result, evidence = judged(field_note_run())
    root = ET.fromstring(render_stage_junit(result, evidence))
    cases = junit_cases(render_stage_junit(result, evidence))
    assert list(cases) == [s.value for s in Stage]
    assert {c.get("classname") for c in cases.values()} == {"gpucanary.ladder"}
    failure = cases["application"].find("failure")
    assert failure is not None and failure.get("message") == result.verdict(Stage.APPLICATION).summary
    skipped = cases["network"].find("skipped")
    assert skipped is not None and "no GPU networking configured" in skipped.get("message")
    assert cases["rollout"].find("failure") is None and cases["rollout"].find("skipped") is None
    properties = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert properties == {"run_id": "r-7f3a", "pool": "canary-0", "driver_from": OLD, "driver_to": NEW}


def test_junit_inconclusive_is_a_failure_with_its_text() -> None:
    result, evidence = judged(clean_run(probes=probes(2)))
    failure = junit_cases(render_stage_junit(result, evidence))["scheduler"].find("failure")
    assert failure is not None and failure.get("type") == "inconclusive"
    assert failure.get("message").startswith("scheduler: pool probe queue delay n=2 < min 3")


def test_markdown_leads_with_the_verdict_and_lists_every_stage() -> None:
    result, evidence = judged(field_note_run())
    text = render_markdown(result, evidence)
    assert text.startswith("# gpucanary launch receipt: Gate FAILED at stage application")
    assert "| network | skipped | network: no GPU networking configured" in text
    assert "| upgrade policy | policies/drain-fallback.yaml |" in text
    passed = render_markdown(*judged(clean_run()))
    assert passed.startswith("# gpucanary launch receipt: Gate PASSED")


def test_write_receipt_writes_the_five_files(tmp_path: Path) -> None:
    evidence = clean_run()
    result, evidence = judged(evidence)
    paths = write_receipt(tmp_path / "run", result, evidence)
    assert {p.name for p in paths.values()} == {"receipt.json", "receipt.md", "receipt.html", "stages.junit.xml",
                                                "verdict.prom"}
    assert parse_json(paths["json"].read_text()) == result
    ET.parse(paths["junit"])


def test_unwritable_receipt_dir_is_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    evidence = clean_run()
    with pytest.raises(EnvError, match="cannot write the receipt"):
        write_receipt(blocker / "run", *judged(evidence))


@pytest.mark.parametrize(("environ", "expected"), [
    ({"GITHUB_RUN_ID": "42", "GITHUB_REPOSITORY": "acme/gpu", "GITHUB_JOB": "canary",
      "GITHUB_SERVER_URL": "https://github.example"},
     {"provider": "github", "repository": "acme/gpu", "run_id": "42", "job": "canary",
      "url": "https://github.example/acme/gpu/actions/runs/42"}),
    ({"CI_JOB_ID": "7", "CI_PROJECT_PATH": "acme/gpu", "CI_JOB_URL": "https://gl/acme/gpu/-/jobs/7",
      "CI_PIPELINE_ID": "3"},
     {"provider": "gitlab", "project": "acme/gpu", "job_id": "7", "pipeline_id": "3",
      "url": "https://gl/acme/gpu/-/jobs/7"}),
    ({"JOB_NAME": "gpu/canary", "BUILD_NUMBER": "11", "BUILD_URL": "https://ci/job/gpu/11/"},
     {"provider": "jenkins", "job": "gpu/canary", "build_number": "11", "url": "https://ci/job/gpu/11/"}),
    ({"HOME": "/root", "BUILD_NUMBER": "11"}, {}),
])
def test_ci_identity(environ: dict[str, str], expected: dict[str, str]) -> None:
    assert ci_identity(environ) == expected


def test_a_helm_rendered_policy_shows_its_chart_notes_in_every_readable_receipt(tmp_path: Path) -> None:
    rendering = ("rendered by helm template from chart charts/gpu-operator",
                 "driver.upgradePolicy.drain.force: not in values -> false (chart default)")
    result, evidence = judged(dataclasses.replace(clean_run(probes=probes(3)), policy_rendering=rendering,
                                                  upgrade_policy={"drain": {"enable": False}}))
    assert RunEvidence.from_json(evidence.to_json(), evidence.records).policy_rendering == rendering
    run = json.loads(render_json(result, evidence))["run"]
    assert (run["policy_rendering"], run["upgrade_policy"]) == (list(rendering), {"drain": {"enable": False}})
    markdown = render_markdown(result, evidence)
    assert "| policy render | driver.upgradePolicy.drain.force: not in values -> false (chart default) |" in markdown
    assert "not in values -&gt; false (chart default)" in render_html(result, evidence)


def test_cluster_text_is_one_escaped_line_in_markdown_and_one_plain_line_in_progress() -> None:
    """Whoever can create an event writes its message: it must not render a link or image in a job summary,
    break a table, or start a line a CI system reads as its own command."""
    hostile = "Pulling ![x](https://evil.example/p.png) [click](https://evil.example) <img src=x> a|b\n::error::owned"
    result, evidence = judged(field_note_run())
    verdict = dataclasses.replace(result.verdicts[0], summary=hostile)
    result = dataclasses.replace(result, verdicts=(verdict, *result.verdicts[1:]))
    text = render_markdown(result, evidence)
    row = next(line for line in text.splitlines() if line.startswith(f"| {verdict.stage.value} |"))
    assert "!\\[x\\](https://evil.example/p.png) \\[click\\](https://evil.example) \\<img src=x> a\\|b ::error::owned" in row
    assert not any(line.startswith("::error::") for line in text.splitlines())
    lines: list[str] = []
    ProgressLine(lines.append).line(hostile + "\x1b[2J\r")
    assert len(lines) == 1 and "\n" not in lines[0] and "\x1b" not in lines[0] and "\r" not in lines[0]
    assert lines[0].endswith("a|b ::error::owned")


def test_a_url_is_written_without_its_credentials() -> None:
    assert redact_url("https://ci:s3cret@prom.example:9443/api?token=abc&step=5") == \
        "https://***@prom.example:9443/api?token=***&step=5"
    with pytest.raises(MetricsError) as unreachable:
        query("up", url="http://ci:s3cret@127.0.0.1:9", connect_timeout_s=0.5, read_timeout_s=0.5)
    assert "s3cret" not in str(unreachable.value) and "***@127.0.0.1:9" in str(unreachable.value)
