"""The Markdown receipt (for a job summary or a PR comment): headline, run, stages, evidence."""

from __future__ import annotations

from pytest_gpucanary.ladder import LadderResult, RunEvidence
from pytest_gpucanary.receipt.common import headline, offset, run_rows
from pytest_gpucanary.safe_text import markdown as _cell


def render_markdown(result: LadderResult, evidence: RunEvidence) -> str:
    lines = [f"# gpucanary launch receipt: {headline(result)}", ""]
    if result.first_failed:
        lines += [f"**{_cell(result.verdict(result.first_failed).summary)}**", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in run_rows(evidence)]
    lines += ["", "## Stages", "", "| stage | outcome | summary |", "|---|---|---|"]
    lines += [f"| {v.stage.value} | {v.outcome.value} | {_cell(v.summary)} |" for v in result.verdicts]
    if result.capacity:
        lines += ["", "## GPU capacity", ""] + [f"- {_cell(c.line())}" for c in result.capacity]
    if evidence.collective or evidence.collective_note:
        lines += ["", "## Collective probe", ""]
        lines += [f"- `{evidence.offset_s(c.started_wall_ns):+.0f}s` {_cell(c.line())}" for c in evidence.collective]
        lines += [f"- {_cell(evidence.collective_note)}"] if evidence.collective_note else []
    for v in result.verdicts:
        if v.evidence:
            lines += ["", f"### {v.stage.value}: evidence ({v.outcome.value})", ""]
            lines += [f"- `{offset(e) or 'n/a'}` {_cell(e.kind)} {_cell(e.ref)}: {_cell(e.text)}" for e in v.evidence]
    lines += ["", "Times are client receive times (wall clock); offsets are seconds from the upgrade start."]
    return "\n".join(lines) + "\n"
