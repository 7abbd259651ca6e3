"""The gate's side-by-side receipt (base vs head): Markdown for a PR comment, JSON, and HTML with both
timelines on one time axis.

Draws what `ladder.compare` computed and what the policy diff found, never judges. Offsets are seconds
from each run's own upgrade start (client receive time), so the two timelines line up at 0.
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Sequence
from pathlib import Path

from pytest_gpucanary.config import flag
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.ladder import UpgradePhase
from pytest_gpucanary.ladder.model import Outcome
from pytest_gpucanary.policy.diff import Change
from pytest_gpucanary.policy.lint import Finding
from pytest_gpucanary.premerge.compare import Comparison, Side, eviction_diff, stage_pairs
from pytest_gpucanary.receipt.html import OUTCOME_COLOURS, _badge, scale_of, shared_scale, timeline_svg

SCHEMA = "gpucanary-gate-receipt/1"
FILES = {"json": "gate.json", "markdown": "gate.md", "html": "gate.html"}


def _phase(side: Side, phase: UpgradePhase) -> str:
    s = next((s for s in side.evidence.service_phases if s.phase is phase), None)
    if s is None or not s.requests:
        return "no requests"
    p99 = "-" if s.p99_s is None else f"{s.p99_s:.3f} s"
    return f"{s.failures}/{s.requests} failed, p99 {p99}"


def _upgrade(side: Side) -> str:
    seconds = side.upgrade_s()
    return "no upgrade-done" if seconds is None else f"{seconds:.0f} s"


def _change_line(change: Change) -> str:
    return f"{change.path}: {json.dumps(change.old)} -> {json.dumps(change.new)}"


def rows(comparison: Comparison) -> list[tuple[str, str, str]]:
    """The side-by-side table every format shows: (what, base, head)."""
    base, head = comparison.base, comparison.head
    table = [
        ("run id", base.evidence.run_id, head.evidence.run_id),
        ("policy", base.evidence.policy_path, head.evidence.policy_path),
        (
            "driver",
            f"{base.evidence.driver_from} -> {base.evidence.driver_to}",
            f"{head.evidence.driver_from} -> {head.evidence.driver_to}",
        ),
        ("gate", "passed" if base.result.gate_passed else "failed", "passed" if head.result.gate_passed else "failed"),
    ]
    table += [
        (f"stage {stage.value}", was.value if was else "-", now.value if now else "-")
        for stage, was, now in stage_pairs(comparison)
    ]
    table += [("evictions", str(len(base.result.evictions)), str(len(head.result.evictions)))]
    table += [(f"service {phase.value}", _phase(base, phase), _phase(head, phase)) for phase in UpgradePhase]
    table += [("upgrade time (to upgrade-done)", _upgrade(base), _upgrade(head))]
    return table


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_gate_markdown(comparison: Comparison, changes: Sequence[Change], findings: Sequence[Finding]) -> str:
    lines = [f"# gpucanary gate: {comparison.headline()}", ""]
    lines += [f"- **{r.rule}**: {_cell(r.line)}" for r in comparison.regressions] + [""] * bool(comparison.regressions)
    lines += ["| | base | head |", "|---|---|---|"]
    lines += [f"| {_cell(a)} | {_cell(b)} | {_cell(c)} |" for a, b, c in rows(comparison)]
    only_base, only_head = eviction_diff(comparison.base, comparison.head)
    if only_base or only_head:
        lines += ["", "## Evictions that differ", ""]
        lines += [f"- base only: {_cell(e.line())}" for e in only_base]
        lines += [f"- head only: {_cell(e.line())}" for e in only_head]
    lines += ["", "## Policy changes (base -> head)", ""]
    if not changes:
        lines += ["No upgrade-policy knob changed."]
    for change in changes:
        lines += [f"- `{_cell(_change_line(change))}`"]
        lines += [f"  - adds {_cell(f.line())}" for f in change.introduced]
        lines += [f"  - removes {_cell(f.line())}" for f in change.removed]
    if findings:
        lines += ["", "Lint of head:", ""] + [f"- {_cell(f.line())}" for f in findings]
    lines += [
        "",
        "Offsets are seconds from each run's upgrade start (client receive time); service figures are "
        "the load generator's.",
    ]
    return "\n".join(lines) + "\n"


def _finding(f: Finding) -> dict[str, str]:
    return {"severity": f.severity.value, "code": f.code, "path": f.path, "message": f.message}


def render_gate_json(comparison: Comparison, changes: Sequence[Change], findings: Sequence[Finding]) -> str:
    only_base, only_head = eviction_diff(comparison.base, comparison.head)
    side = {
        s.label: {
            "run_id": s.evidence.run_id,
            "policy_path": s.evidence.policy_path,
            "gate_passed": s.result.gate_passed,
            "first_failed": s.result.first_failed.value if s.result.first_failed else None,
            "upgrade_s": s.upgrade_s(),
            "evictions": [dataclasses.asdict(e) for e in s.result.evictions],
            "service_phases": [dataclasses.asdict(p) for p in s.evidence.service_phases],
        }
        for s in (comparison.base, comparison.head)
    }
    document = {
        "schema": SCHEMA,
        "gate_passed": comparison.gate_passed,
        "headline": comparison.headline(),
        "regressions": [dataclasses.asdict(r) for r in comparison.regressions],
        "stages": [
            {"stage": st.value, "base": a.value if a else None, "head": b.value if b else None}
            for st, a, b in stage_pairs(comparison)
        ],
        "evictions_only_base": [e.line() for e in only_base],
        "evictions_only_head": [e.line() for e in only_head],
        "changes": [
            {
                "knob": c.knob,
                "path": c.path,
                "old": c.old,
                "new": c.new,
                "introduced": [_finding(f) for f in c.introduced],
                "removed": [_finding(f) for f in c.removed],
            }
            for c in changes
        ],
        "head_findings": [_finding(f) for f in findings],
        **side,
    }
    return json.dumps(document, indent=1, default=str) + "\n"


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpucanary gate {base_id} vs {head_id}</title>
<style>
body{{font:14px system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}}
table{{border-collapse:collapse;margin:.5em 0}} td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}} th{{background:#f5f5f5}} .banner{{padding:.8em 1em;color:#fff;border-radius:4px}}
.outcome{{color:#fff;font-weight:600;padding:1px 6px;border-radius:3px}} .note{{color:#555;font-size:12px}}
</style></head><body>
<div class="banner" style="background:{banner_colour}"><h1 style="margin:0;font-size:22px">{headline}</h1></div>
{regressions}
<h2>Base vs head</h2>{table}
<h2>Timelines (one time axis)</h2>
<h3 id="timeline-base">base: {base_policy}</h3>{base_svg}
<h3 id="timeline-head">head: {head_policy}</h3>{head_svg}
<p class="note">x: seconds from each run's own upgrade start (client receive time), the same scale for both.</p>
<h2>Evictions that differ</h2>{evictions}
<h2>Policy changes (base -&gt; head)</h2>{changes}
</body></html>
"""


def _outcome_cell(text: str) -> str:
    try:
        return _badge(Outcome(text))
    except ValueError:
        return html.escape(text)


def render_gate_html(comparison: Comparison, changes: Sequence[Change], findings: Sequence[Finding]) -> str:
    base, head = comparison.base, comparison.head
    scale = shared_scale(scale_of(base.evidence), scale_of(head.evidence))
    table = "".join(
        f"<tr><th>{html.escape(a)}</th><td>{_outcome_cell(b)}</td><td>{_outcome_cell(c)}</td></tr>"
        for a, b, c in rows(comparison)
    )
    regressions = "".join(
        f"<li><b>{html.escape(r.rule)}</b>: {html.escape(r.line)}</li>" for r in comparison.regressions
    )
    only_base, only_head = eviction_diff(base, head)
    evictions = "".join(
        [f"<li>base only: {html.escape(e.line())}</li>" for e in only_base]
        + [f"<li>head only: {html.escape(e.line())}</li>" for e in only_head]
    )
    change_items = "".join(
        f"<li><code>{html.escape(_change_line(c))}</code><ul>"
        + "".join(f"<li>adds {html.escape(f.line())}</li>" for f in c.introduced)
        + "".join(f"<li>removes {html.escape(f.line())}</li>" for f in c.removed)
        + "</ul></li>"
        for c in changes
    )
    return PAGE.format(
        base_id=html.escape(base.evidence.run_id),
        head_id=html.escape(head.evidence.run_id),
        banner_colour=OUTCOME_COLOURS[Outcome.PASS if comparison.gate_passed else Outcome.FAIL],
        headline=html.escape(comparison.headline()),
        regressions=f"<ul>{regressions}</ul>" if regressions else "",
        table=f"<table><tr><th></th><th>base</th><th>head</th></tr>{table}</table>",
        base_policy=html.escape(base.evidence.policy_path),
        head_policy=html.escape(head.evidence.policy_path),
        base_svg=timeline_svg(base.result, base.evidence, scale=scale, label="upgrade timeline base"),
        head_svg=timeline_svg(head.result, head.evidence, scale=scale, label="upgrade timeline head"),
        evictions=f"<ul>{evictions}</ul>" if evictions else "<p class='note'>the same on both runs</p>",
        changes=(f"<ul>{change_items}</ul>" if changes else "<p class='note'>no upgrade-policy knob changed</p>")
        + "".join(f"<p class='note'>head lint: {html.escape(f.line())}</p>" for f in findings),
    )


RENDERERS = {"json": render_gate_json, "markdown": render_gate_markdown, "html": render_gate_html}


def write_gate_receipt(
    gate_dir: Path, comparison: Comparison, changes: Sequence[Change], findings: Sequence[Finding]
) -> dict[str, Path]:
    paths = {key: Path(gate_dir) / name for key, name in FILES.items()}
    try:
        Path(gate_dir).mkdir(parents=True, exist_ok=True)
        for key, render in RENDERERS.items():
            paths[key].write_text(render(comparison, changes, findings), encoding="utf-8")
    except OSError as err:
        raise EnvError(
            f"cannot write the gate receipt into {str(gate_dir)!r}: {err.strerror}",
            hint=f"point {flag('reports_dir')} at a writable directory",
        ) from err
    return paths
