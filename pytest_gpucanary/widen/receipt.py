"""The sweep's receipt: JSON, Markdown, HTML (the waves on one time axis, each node's upgrade states, the
pods removed) and JUnit with one testcase per wave. Draws the record; never judges. Pure."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path

from junit_xml import TestCase, TestSuite

from pytest_gpucanary.receipt.common import utc
from pytest_gpucanary.receipt.junit import junit_document
from pytest_gpucanary.widen.state import FAILED, PASSED, PENDING, Sweep, Wave

FILES = ("widen.json", "widen.md", "widen.html", "widen-junit.xml")
JUNIT_CLASSNAME = "gpucanary.widen"


def write(report_dir: Path, sweep: Sweep) -> dict[str, Path]:
    report_dir.mkdir(parents=True, exist_ok=True)
    texts = (render_json(sweep), render_markdown(sweep), render_html(sweep), render_junit(sweep))
    paths = {}
    for name, text in zip(FILES, texts):
        (report_dir / name).write_text(text)
        paths[name] = report_dir / name
    return paths


def headline(sweep: Sweep) -> str:
    failed = next((i for i, w in enumerate(sweep.waves) if w.outcome == FAILED), None)
    if failed is not None:
        return f"widen {sweep.status}: wave {failed + 1}/{len(sweep.waves)} failed: {sweep.waves[failed].signal}"
    passed = sum(w.outcome == PASSED for w in sweep.waves)
    return f"widen {sweep.status}: {passed}/{len(sweep.waves)} waves passed, {len(sweep.nodes())} nodes"


def render_json(sweep: Sweep) -> str:
    record = asdict(sweep)
    record["key"] = sweep.key.labels()
    record["headline"] = headline(sweep)
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def _wave_line(wave: Wave) -> str:
    removed = ", ".join(d.line() + ("" if d.allowed else " (not allowed)") for d in wave.disruptions) or "none"
    took = f"{(wave.ended_wall_ns - wave.started_wall_ns) / 1e9:.0f} s" if wave.ended_wall_ns else "-"
    return (
        f"| {wave.outcome} | {', '.join(wave.nodes)} | {utc(wave.started_wall_ns) if wave.started_wall_ns else '-'} "
        f"| {took} | {removed} | {wave.probes or '-'} | {wave.signal or '-'} |"
    )


def render_markdown(sweep: Sweep) -> str:
    lines = [
        f"# {headline(sweep)}",
        "",
        f"- sweep `{sweep.run_id}`: {sweep.target[1]} {sweep.target[2]}, driver {sweep.prior_version} to "
        f"{sweep.key.target}, GPU Operator {sweep.key.release or 'unknown'}",
        f"- policy `{sweep.key.policy_digest}`, on the verdict of canary run `{sweep.verdict_run}`",
        f"- waves: {sweep.strategy}, soak {sweep.soak_s:g} s",
        "",
    ]
    if sweep.rollback:
        lines += [f"Rolled back: {sweep.rollback}.", ""]
    lines += [
        "| # | outcome | nodes | started | took | pods removed | start probes | signal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {i + 1} " + _wave_line(w) for i, w in enumerate(sweep.waves)]
    return "\n".join(lines) + "\n"


STATE_COLOURS = {"upgrade-done": "#2e7d32", "upgrade-failed": "#c62828", "upgrade-required": "#9e9e9e"}


def render_html(sweep: Sweep) -> str:
    """The waves on one time axis: a band per node, coloured by its upgrade state, and a tick per pod removed."""
    stamps = [t for w in sweep.waves for seen in w.states.values() for t, _ in seen] + [
        t for w in sweep.waves for t in (w.started_wall_ns, w.ended_wall_ns) if t
    ]
    start, end = (min(stamps), max(stamps)) if stamps else (0, 1)
    width, left, row = 900.0, 160.0, 18.0

    def x(wall_ns: int) -> float:
        return left + (wall_ns - start) / max(1, end - start) * (width - left - 10)

    parts, y = [], 10.0
    for i, wave in enumerate(sweep.waves):
        parts.append(f'<text x="4" y="{y + 12}" font-weight="bold">wave {i + 1}: {html.escape(wave.outcome)}</text>')
        y += row
        for node in wave.nodes:
            parts.append(f'<text x="14" y="{y + 12}">{html.escape(node)}</text>')
            seen = wave.states.get(node, [])
            for (t, label), nxt in zip(seen, [*seen[1:], (wave.ended_wall_ns or end, "")]):
                colour = STATE_COLOURS.get(label, "#f9a825")
                parts.append(
                    f'<rect x="{x(t):.1f}" y="{y + 2}" width="{max(1.0, x(nxt[0]) - x(t)):.1f}" '
                    f'height="{row - 4}" fill="{colour}"><title>{html.escape(label or "no state")} '
                    f"from {utc(t)}</title></rect>"
                )
            for d in wave.disruptions:
                if d.node == node:
                    parts.append(
                        f'<line x1="{x(d.wall_ns):.1f}" x2="{x(d.wall_ns):.1f}" y1="{y}" y2="{y + row}" '
                        f'stroke="{"#000" if d.allowed else "#d50000"}" stroke-width="2">'
                        f"<title>{html.escape(d.line())}</title></line>"
                    )
            y += row
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y + 10:.0f}" '
        f'font-family="sans-serif" font-size="11">{"".join(parts)}</svg>'
    )
    rows = "".join(
        f"<tr><td>{i + 1}</td>"
        + "".join(f"<td>{html.escape(cell.strip())}</td>" for cell in _wave_line(w).strip("|").split("|"))
        + "</tr>"
        for i, w in enumerate(sweep.waves)
    )
    return (
        f"<!doctype html><meta charset=utf-8><title>{html.escape(headline(sweep))}</title>"
        f"<h1>{html.escape(headline(sweep))}</h1>{svg}"
        "<table border=1><tr><th>#</th><th>outcome</th><th>nodes</th><th>started</th><th>took</th>"
        f"<th>pods removed</th><th>start probes</th><th>signal</th></tr>{rows}</table>\n"
    )


def render_junit(sweep: Sweep) -> str:
    cases = []
    for i, wave in enumerate(sweep.waves):
        case = TestCase(
            f"wave {i + 1}",
            classname=JUNIT_CLASSNAME,
            stdout=_wave_line(wave),
            elapsed_sec=(wave.ended_wall_ns - wave.started_wall_ns) / 1e9 if wave.ended_wall_ns else None,
        )
        if wave.outcome == FAILED:
            case.add_failure_info(message=wave.signal, output=wave.signal, failure_type="failed")
        elif wave.outcome == PENDING:
            case.add_skipped_info(message="held on the old driver: an earlier wave failed or the sweep stopped")
        cases.append(case)
    suite = TestSuite(
        "gpucanary widen",
        cases,
        timestamp=utc(sweep.started_wall_ns),
        properties={
            "run_id": sweep.run_id,
            "driver_from": sweep.prior_version,
            "driver_to": sweep.key.target,
            "status": sweep.status,
        },
    )
    return junit_document(suite)
