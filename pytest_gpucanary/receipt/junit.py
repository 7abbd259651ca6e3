"""The stage JUnit file: one testcase per ladder stage, for pipeline UIs."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from junit_xml import TestCase, TestSuite, to_xml_report_string

from pytest_gpucanary.ladder import LadderResult, Outcome, RunEvidence
from pytest_gpucanary.receipt.common import neighbour_acts, offset, utc

JUNIT_CLASSNAME = "gpucanary.ladder"


def render_stage_junit(result: LadderResult, evidence: RunEvidence) -> str:
    """junit-xml drops a failure without text, so every failure carries its summary."""
    cases = []
    for v in result.verdicts:
        case = TestCase(
            v.stage.value,
            classname=JUNIT_CLASSNAME,
            stdout="\n".join(f"{offset(e)} {e.kind} {e.ref}: {e.text}".strip() for e in v.evidence),
        )
        if v.outcome in (Outcome.FAIL, Outcome.INCONCLUSIVE):
            case.add_failure_info(message=v.summary, output=v.summary, failure_type=v.outcome.value)
        elif v.outcome is Outcome.SKIPPED:
            case.add_skipped_info(message=v.summary)
        cases.append(case)
    properties = {
        "run_id": evidence.run_id,
        "pool": ",".join(evidence.pool_nodes),
        "driver_from": evidence.driver_from,
        "driver_to": evidence.driver_to,
    }
    others = [f"{evidence.offset_s(a.wall_ns):+.1f} s others on the pool: {a.line()}" for a in neighbour_acts(evidence)]
    suite = TestSuite(
        "gpucanary ladder",
        cases,
        properties=properties,
        timestamp=utc(evidence.upgrade_started_wall_ns),
        stdout="\n".join(others) or None,
    )
    return junit_document(suite)


def junit_document(suite: TestSuite) -> str:
    """The suite as a JUnit file every pipeline UI reads."""
    # junit-xml adds `disabled` counts, which strict schemas (Jenkins xUnit's junit-10.xsd) refuse
    root = ET.fromstring(to_xml_report_string([suite], prettyprint=False))
    for element in root.iter():
        element.attrib.pop("disabled", None)
    ET.indent(root, space="\t")
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
