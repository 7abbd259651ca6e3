"""The launch receipt: JSON, Markdown, HTML (receipt_html.py) and a JUnit file with one testcase per stage.

Pure rendering of a `LadderResult` plus who/what/when (`RunInfo`); decides nothing about the gate.
Times are client wall-clock times; offsets are seconds from the upgrade start.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from junit_xml import TestCase, TestSuite, to_xml_report_string

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.ladder import Evidence, LadderResult, Outcome, RunEvidence, Stage, StageVerdict, Thresholds
from pytest_gpucanary.receipt_html import render_html

SCHEMA = "gpucanary-receipt/1"
JUNIT_CLASSNAME = "gpucanary.ladder"
FILES = {"json": "receipt.json", "markdown": "receipt.md", "html": "receipt.html", "junit": "stages.junit.xml"}

__all__ = ["RunInfo", "ci_identity", "parse_json", "render_html", "render_json", "render_markdown",
           "render_stage_junit", "write_receipt"]


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    pool_nodes: tuple[str, ...]
    driver_from: str
    driver_to: str
    policy_path: str
    gpu_job_name: str
    gpu_job_uid: str
    started_wall_ns: int           # client wall clock, Unix ns
    finished_wall_ns: int
    ci: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pool_nodes", tuple(self.pool_nodes))


# --- CI identity -------------------------------------------------------------------------------------

def _github(env: Mapping[str, str]) -> dict[str, str]:
    if not env.get("GITHUB_RUN_ID"):
        return {}
    ids = {"provider": "github", "repository": env.get("GITHUB_REPOSITORY", ""), "run_id": env["GITHUB_RUN_ID"],
           "job": env.get("GITHUB_JOB", "")}
    if ids["repository"]:
        server = env.get("GITHUB_SERVER_URL", "https://github.com").rstrip("/")
        ids["url"] = f"{server}/{ids['repository']}/actions/runs/{ids['run_id']}"
    return ids


def _gitlab(env: Mapping[str, str]) -> dict[str, str]:
    if not env.get("CI_JOB_ID"):
        return {}
    return {"provider": "gitlab", "project": env.get("CI_PROJECT_PATH", ""), "job_id": env["CI_JOB_ID"],
            "pipeline_id": env.get("CI_PIPELINE_ID", ""), "url": env.get("CI_JOB_URL", "")}


def _jenkins(env: Mapping[str, str]) -> dict[str, str]:
    if not (env.get("BUILD_NUMBER") and env.get("JOB_NAME")):
        return {}
    return {"provider": "jenkins", "job": env["JOB_NAME"], "build_number": env["BUILD_NUMBER"],
            "url": env.get("BUILD_URL", "")}


CI_PROVIDERS: tuple[Callable[[Mapping[str, str]], dict[str, str]], ...] = (_github, _gitlab, _jenkins)


def ci_identity(environ: Mapping[str, str]) -> dict[str, str]:
    """Who ran the gate: the first CI whose variables are set; empty values left out; {} outside CI."""
    for provider in CI_PROVIDERS:
        if ids := provider(environ):
            return {k: v for k, v in ids.items() if v}
    return {}


# --- JSON --------------------------------------------------------------------------------------------

def utc(wall_ns: int | None) -> str:
    if wall_ns is None:
        return "-"
    return datetime.fromtimestamp(wall_ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds")


def render_json(result: LadderResult, info: RunInfo) -> str:
    document = {
        "schema": SCHEMA,
        "gate_passed": result.gate_passed,
        "first_failed": result.first_failed.value if result.first_failed else None,
        "run": {**dataclasses.asdict(info), "started_utc": utc(info.started_wall_ns),
                "finished_utc": utc(info.finished_wall_ns)},
        "thresholds": dataclasses.asdict(result.thresholds),
        "verdicts": [{"stage": v.stage.value, "outcome": v.outcome.value, "summary": v.summary,
                    "evidence": [dataclasses.asdict(e) for e in v.evidence]} for v in result.verdicts],
    }
    return json.dumps(document, indent=1, default=str) + "\n"


def parse_json(text: str) -> tuple[LadderResult, RunInfo]:
    """Read a receipt back (for gates that compare runs); inverse of `render_json`."""
    document: dict[str, Any] = json.loads(text)
    run = {k: v for k, v in document["run"].items() if k not in ("started_utc", "finished_utc")}
    info = RunInfo(**{**run, "pool_nodes": tuple(run["pool_nodes"])})
    verdicts = tuple(StageVerdict(Stage(s["stage"]), Outcome(s["outcome"]), s["summary"],
                                  tuple(Evidence(**e) for e in s["evidence"])) for s in document["verdicts"])
    first = document["first_failed"]
    result = LadderResult(verdicts, Stage(first) if first else None, document["gate_passed"],
                          Thresholds(**document["thresholds"]))
    return result, info


# --- Markdown ----------------------------------------------------------------------------------------

def headline(result: LadderResult) -> str:
    if result.gate_passed:
        return "Gate PASSED: wider rollout may proceed"
    return f"Gate FAILED at stage {result.first_failed.value}: do not roll out wider"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _offset(evidence: Evidence) -> str:
    return "" if evidence.offset_s is None else f"{evidence.offset_s:+.1f} s"


def run_rows(info: RunInfo) -> list[tuple[str, str]]:
    ci = ", ".join(f"{k}={v}" for k, v in info.ci.items()) or "not in CI"
    return [("run id", info.run_id), ("pool", ", ".join(info.pool_nodes)),
            ("driver", f"{info.driver_from} -> {info.driver_to}"), ("upgrade policy", info.policy_path),
            ("GPU job", f"{info.gpu_job_name} (uid {info.gpu_job_uid or 'unknown'})"),
            ("started", utc(info.started_wall_ns)), ("finished", utc(info.finished_wall_ns)), ("CI", ci)]


def render_markdown(result: LadderResult, info: RunInfo) -> str:
    lines = [f"# gpucanary launch receipt: {headline(result)}", ""]
    if result.first_failed:
        lines += [f"**{_cell(result.verdict(result.first_failed).summary)}**", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in run_rows(info)]
    lines += ["", "## Stages", "", "| stage | outcome | summary |", "|---|---|---|"]
    lines += [f"| {v.stage.value} | {v.outcome.value} | {_cell(v.summary)} |" for v in result.verdicts]
    for v in result.verdicts:
        if v.evidence:
            lines += ["", f"### {v.stage.value}: evidence ({v.outcome.value})", ""]
            lines += [f"- `{_offset(e) or 'n/a'}` {e.kind} {e.ref}: {e.text}" for e in v.evidence]
    lines += ["", "Times are client receive times (wall clock); offsets are seconds from the upgrade start."]
    return "\n".join(lines) + "\n"


# --- JUnit -------------------------------------------------------------------------------------------

def render_stage_junit(result: LadderResult, info: RunInfo) -> str:
    """One testcase per stage. junit-xml drops a failure without text, so every failure carries its summary."""
    cases = []
    for v in result.verdicts:
        case = TestCase(v.stage.value, classname=JUNIT_CLASSNAME,
                        stdout="\n".join(f"{_offset(e)} {e.kind} {e.ref}: {e.text}".strip() for e in v.evidence))
        if v.outcome in (Outcome.FAIL, Outcome.INCONCLUSIVE):
            case.add_failure_info(message=v.summary, output=v.summary, failure_type=v.outcome.value)
        elif v.outcome is Outcome.SKIPPED:
            case.add_skipped_info(message=v.summary)
        cases.append(case)
    properties = {"run_id": info.run_id, "pool": ",".join(info.pool_nodes), "driver_from": info.driver_from,
                  "driver_to": info.driver_to}
    suite = TestSuite("gpucanary ladder", cases, properties=properties, timestamp=utc(info.started_wall_ns))
    return to_xml_report_string([suite])


# --- files -------------------------------------------------------------------------------------------

def write_receipt(dir: Path, result: LadderResult, info: RunInfo, evidence: RunEvidence) -> dict[str, Path]:
    """Write the four receipt files into `dir`; returns their paths by format."""
    texts = {"json": render_json(result, info), "markdown": render_markdown(result, info),
             "html": render_html(result, info, evidence), "junit": render_stage_junit(result, info)}
    paths = {key: Path(dir) / FILES[key] for key in texts}
    try:
        Path(dir).mkdir(parents=True, exist_ok=True)
        for key, text in texts.items():
            paths[key].write_text(text, encoding="utf-8")
    except OSError as err:
        raise EnvError(f"cannot write the receipt into {str(dir)!r}: {err.strerror}",
                       hint="point --gpucanary-receipt-dir at a writable directory") from err
    return paths
