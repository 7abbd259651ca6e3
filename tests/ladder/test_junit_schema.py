"""Both JUnit files a gate writes validate against the Jenkins xUnit plugin's strict schema.

pytest's --junitxml file (what the CI templates publish) comes from the shipped canaries run by
pytester against a canned run outcome; reports/<run>/stages.junit.xml (kept as an artifact) from
`render_stage_junit` on canned ladder results. Schema: tests/schemas/junit-10.xsd (see its README).
"""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema
from canned_runs import clean_run, field_note_run, probes  # canned runs, shared
from test_receipt import judged

from pytest_gpucanary.ladder import Stage
from pytest_gpucanary.receipt.junit import render_stage_junit
from pytest_gpucanary.shipped import CANARIES, FIXTURES

SCHEMA = xmlschema.XMLSchema10(Path(__file__).parent.parent / "schemas" / "junit-10.xsd")


def assert_valid(xml_text: str) -> None:
    errors = [f"{e.path}: {e.reason}" for e in SCHEMA.iter_errors(xml_text)]
    assert errors == [], "\n".join(errors)


def test_the_schema_rejects_what_the_old_files_had() -> None:
    """The two faults seen in the field: a `disabled` attribute, and <properties> inside <testcase>."""
    with pytest.raises(xmlschema.XMLSchemaValidationError, match="disabled"):
        SCHEMA.validate('<testsuite name="s" tests="0" failures="0" errors="0" disabled="0"/>')
    with pytest.raises(xmlschema.XMLSchemaValidationError, match="properties"):
        SCHEMA.validate('<testsuite name="s" tests="1" failures="0" errors="0"><testcase name="t">'
                        '<properties><property name="a" value="b"/></properties></testcase></testsuite>')


@pytest.mark.parametrize("evidence", [field_note_run(), clean_run(), clean_run(probes=probes(2))],
                         ids=["failed-at-application", "passed", "inconclusive-scheduler"])
def test_stage_junit_validates(evidence) -> None:
    result, evidence = judged(evidence)
    text = render_stage_junit(result, evidence)
    assert_valid(text)
    root = ET.fromstring(text)
    suite = root.find("testsuite")
    assert suite is not None and suite.get("tests") == "5"
    for case in suite.iter("testcase"):
        failure = case.find("failure")
        if failure is not None:   # the first line names the stage, then the measured value and its limit
            assert failure.get("message").splitlines()[0] == result.verdict(Stage(case.get("name"))).summary
            assert failure.get("message").startswith(f"{case.get('name')}: ")


def test_stage_junit_keeps_its_counts_without_the_disabled_attribute() -> None:
    result, evidence = judged(field_note_run())
    root = ET.fromstring(render_stage_junit(result, evidence))
    suite = root.find("testsuite")
    assert {k: root.get(k) for k in ("tests", "failures", "errors")} == {"tests": "5", "failures": "1", "errors": "0"}
    assert {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": "5", "failures": "1", "errors": "0", "skipped": "1"}
    assert all("disabled" not in element.attrib for element in root.iter())


# A canned outcome of the shipped gate: what `gpucanary_run` returns after a run that failed at
# application, with the stage summaries the ladder writes.
CONFTEST = '''
import pytest
from pytest_gpucanary.canary.outcome import RunOutcome
from pytest_gpucanary.config import Settings
from pytest_gpucanary.ladder import Outcome, RunEvidence, Stage, StageVerdict, WorkloadRef, decide

SUMMARIES = {
    "rollout": (Outcome.PASS, "rollout: canary-0 reached upgrade-done in 50.7 s <= budget 1200 s"),
    "device": (Outcome.PASS, "device: validator Ready, 8/8 GPUs allocatable, driver 580.95.05 = target"),
    "network": (Outcome.SKIPPED, "network: one-node pool: no multi-node collective probe possible"),
    "scheduler": (Outcome.PASS, "scheduler: pool probe queue delay p100 12.0 s <= 300 s (n=6)"),
    "application": (Outcome.FAIL, "application: non-GPU pod ns/sched-api-1 evicted by drain at +1s "
                                  "(allowed: GPU pods only)\\nsecond line: the evidence"),
}

@pytest.fixture(scope="session")
def gpucanary_run(tmp_path_factory):
    evidence = RunEvidence(records=(), pool_nodes=("canary-0",), driver_from="580.82.07", driver_to="580.95.05",
                           upgrade_started_wall_ns=0, gpu_job=WorkloadRef("ns", "train"),
                           service=WorkloadRef("ns", "sched-api"), run_id="ci-42-1")
    settings = Settings()
    result = decide([StageVerdict(Stage(s), o, text) for s, (o, text) in SUMMARIES.items()], settings)
    return RunOutcome(evidence, result, settings, tmp_path_factory.mktemp("reports"))
'''


@pytest.fixture
def canary_junit(pytester: pytest.Pytester) -> tuple[pytest.RunResult, Path]:
    shutil.copy(CANARIES / "test_driver_rollout.py", pytester.path / "test_driver_rollout.py")
    pytester.makeconftest(CONFTEST)
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:locust", f"--junitxml={junit}",
                                           f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}",
                                           "--gpucanary-driver-version=580.95.05")
    return result, junit


def test_pytest_junit_of_the_shipped_canaries_validates(canary_junit: tuple[pytest.RunResult, Path]) -> None:
    result, junit = canary_junit
    result.assert_outcomes(passed=3, skipped=1, failed=1)
    text = junit.read_text()
    assert_valid(text)
    suite = ET.fromstring(text).find("testsuite")
    assert suite is not None and suite.get("tests") == "5" and suite.get("failures") == "1"
    assert all(case.find("properties") is None for case in suite.iter("testcase"))


def test_run_properties_sit_once_on_the_testsuite(canary_junit: tuple[pytest.RunResult, Path]) -> None:
    _, junit = canary_junit
    suite = ET.fromstring(junit.read_text()).find("testsuite")
    assert suite is not None
    properties = [(p.get("name"), p.get("value")) for p in suite.find("properties").iter("property")]
    run_level = [(n, v) for n, v in properties if not n.startswith("gpucanary_stage")]
    assert run_level == [("gpucanary_run_id", "ci-42-1"), ("gpucanary_pool", "canary-0"),
                         ("gpucanary_driver_from", "580.82.07"), ("gpucanary_driver_to", "580.95.05")]
    stages = {n.split(":", 1)[1].rsplit("::", 1)[1]: v for n, v in properties if n.startswith("gpucanary_stage:")}
    assert stages == {
        "test_pool_reaches_upgrade_done_within_budget_touching_only_promised_pods": "rollout",
        "test_validators_ready_gpus_allocatable_and_driver_at_target": "device",
        "test_multi_node_collective_probe_completes": "network",
        "test_probes_admitted_with_queue_delay_and_start_latency_in_bounds": "scheduler",
        "test_gpu_job_resumes_and_service_keeps_running_without_unexpected_evictions": "application",
    }


def test_pytest_failure_message_starts_with_the_stage_line(canary_junit: tuple[pytest.RunResult, Path]) -> None:
    _, junit = canary_junit
    suite = ET.fromstring(junit.read_text()).find("testsuite")
    assert suite is not None
    [failure] = [c.find("failure") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failure.get("message").splitlines()[0] == (
        "application: non-GPU pod ns/sched-api-1 evicted by drain at +1s (allowed: GPU pods only)")
