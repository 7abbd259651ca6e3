"""The HTML launch receipt: one self-contained offline page (inline CSS, inline SVG, no scripts).

Draws what the ladder computed: a band per pool node coloured by upgrade state (the result's state
spans), eviction markers (its evictions), the stall the rollout rung named (its stalls), probe latencies,
load per upgrade phase (its phase windows), then the stage table and its evidence. Decides nothing itself.
x is seconds from the upgrade start, client receive time.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

from pytest_gpucanary.ladder import Eviction, LadderResult, Outcome, ProbeScope, RunEvidence
from pytest_gpucanary.ladder.application import allowed_text
from pytest_gpucanary.ladder.cause import Cause
from pytest_gpucanary.ladder.model import CapacityDip, StateSpan
from pytest_gpucanary.receipt.common import headline, run_rows

OUTCOME_COLOURS = {
    Outcome.PASS: "#2e7d32",
    Outcome.FAIL: "#c62828",
    Outcome.INCONCLUSIVE: "#e65100",
    Outcome.SKIPPED: "#757575",
}
STATE_COLOURS = {
    "": "#eceff1",
    "upgrade-required": "#cfd8dc",
    "cordon-required": "#fff59d",
    "wait-for-jobs-required": "#ffe082",
    "pod-deletion-required": "#ffb74d",
    "drain-required": "#f4511e",
    "pod-restart-required": "#90caf9",
    "validation-required": "#64b5f6",
    "uncordon-required": "#80cbc4",
    "upgrade-done": "#a5d6a7",
    "upgrade-failed": "#e53935",
}
WIDTH, LEFT, RIGHT = 1000, 170, 20
BAND_H, LABEL_H, LANE_H, CAPACITY_H, COLLECTIVE_H = 22, 30, 70, 34, 18

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpucanary launch receipt {run_id}</title>
<style>
body{{font:14px system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}}
table{{border-collapse:collapse;margin:.5em 0}} td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}} th{{background:#f5f5f5}} .banner{{padding:.8em 1em;color:#fff;border-radius:4px}}
.outcome{{color:#fff;font-weight:600;padding:1px 6px;border-radius:3px}} code{{font-size:12px}}
details{{margin:.3em 0}} summary{{cursor:pointer}} .note{{color:#555;font-size:12px}}
</style></head><body>
<div class="banner" style="background:{banner_colour}"><h1 style="margin:0;font-size:22px">{headline}</h1>
<div>{first_summary}</div></div>
<h2>Run</h2>{run_table}
<h2>Timeline</h2>{svg}
<p class="note">x: seconds from the upgrade start (client receive time). Red markers: evictions the policy does not
allow ({allowed}); grey: allowed ones. Purple bracket: a cause that stalled the upgrade, from first seen to the
moment it could no longer clear by itself.</p>
<h2>Stages</h2>{stage_table}
<h2>Evidence</h2>{evidence}
</body></html>
"""


def render_html(result: LadderResult, evidence: RunEvidence) -> str:
    failed = result.verdict(result.first_failed) if result.first_failed else None
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in run_rows(evidence))
    return PAGE.format(
        run_id=html.escape(evidence.run_id),
        headline=html.escape(headline(result)),
        banner_colour=OUTCOME_COLOURS[Outcome.PASS if result.gate_passed else Outcome.FAIL],
        first_summary=html.escape(failed.summary if failed else "every stage passed or was skipped with a reason"),
        run_table=f"<table>{rows}</table>",
        svg=timeline_svg(result, evidence),
        allowed=html.escape(allowed_text(result.thresholds["allowed_evictions"])),
        stage_table=_stage_table(result),
        evidence=_evidence(result),
    )


def _badge(outcome: Outcome) -> str:
    return f'<span class="outcome" style="background:{OUTCOME_COLOURS[outcome]}">{outcome.value}</span>'


def _stage_table(result: LadderResult) -> str:
    rows = []
    for v in result.verdicts:
        mark = " &larr; first failed stage" if v.stage is result.first_failed else ""
        rows.append(
            f"<tr><td><b>{v.stage.value}</b>{mark}</td><td>{_badge(v.outcome)}</td>"
            f"<td>{html.escape(v.summary)}</td></tr>"
        )
    return "<table><tr><th>stage</th><th>outcome</th><th>summary</th></tr>" + "".join(rows) + "</table>"


def _evidence(result: LadderResult) -> str:
    parts = []
    for v in result.verdicts:
        items = "".join(
            f"<tr><td>{'' if e.offset_s is None else f'{e.offset_s:+.1f} s'}</td>"
            f"<td>{html.escape(e.kind)}</td><td><code>{html.escape(e.ref)}</code></td>"
            f"<td>{html.escape(e.text)}</td></tr>"
            for e in v.evidence
        )
        body = (
            f"<table><tr><th>offset</th><th>kind</th><th>object</th><th>what</th></tr>{items}</table>"
            if items
            else "<p class='note'>no evidence items</p>"
        )
        opened = " open" if v.stage is result.first_failed else ""
        parts.append(
            f"<details{opened}><summary>{v.stage.value} {_badge(v.outcome)} ({len(v.evidence)} items)"
            f"</summary>{body}</details>"
        )
    return "".join(parts)


# --- the timeline picture ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    t0_s: float
    t1_s: float

    def x(self, offset_s: float) -> float:
        span = max(self.t1_s - self.t0_s, 1e-9)
        clipped = min(max(offset_s, self.t0_s), self.t1_s)
        return LEFT + (WIDTH - LEFT - RIGHT) * (clipped - self.t0_s) / span


def scale_of(evidence: RunEvidence) -> Scale:
    """From a little before the upgrade start (at most 15 % of the picture) to the end of the recording."""
    offsets = [evidence.offset_s(r.received_wall_ns) for r in evidence.records]
    offsets += [evidence.offset_s(p.created_wall_ns) for p in evidence.probes]
    offsets += [evidence.offset_s(c.started_wall_ns) for c in evidence.collective]
    end_s = max(offsets + [60.0])
    return Scale(min(0.0, max(min(offsets + [0.0]), -0.15 * end_s)), end_s)


def shared_scale(*scales: Scale) -> Scale:
    """One x axis for several runs, each drawn from its own upgrade start (the gate's base and head)."""
    return Scale(min(s.t0_s for s in scales), max(s.t1_s for s in scales))


def timeline_svg(
    result: LadderResult, evidence: RunEvidence, *, scale: Scale | None = None, label: str = "upgrade timeline"
) -> str:
    scale = scale or scale_of(evidence)
    parts, y = [], 10
    for node in evidence.pool_nodes:
        parts += _node_band(evidence, [s for s in result.state_spans if s.node == node], node, scale, y)
        parts += _eviction_marks(evidence, [e for e in result.evictions if e.node == node], scale, y)
        for cause in (c for c in result.stalls if c.node == node):
            parts += _stall_mark(evidence, cause, scale, y)
        y += BAND_H + LABEL_H
    for dip in result.capacity:
        parts += _capacity_lane(dip, scale, y)
        y += CAPACITY_H + 14
    parts += _probe_lane(evidence, scale, y)
    y += LANE_H + 14
    if evidence.collective:
        parts += _collective_lane(evidence, scale, y)
        y += COLLECTIVE_H + 14
    if evidence.service_phases:
        parts += _service_lane(evidence, result, scale, y)
        y += LANE_H + 14
    if evidence.service_rate:
        parts += _rate_lane(evidence, scale, y)
        y += LANE_H + 14
    parts += _axis(scale, y)
    zero = scale.x(0)
    parts.append(
        f'<line x1="{zero:.1f}" y1="4" x2="{zero:.1f}" y2="{y}" stroke="#000" stroke-dasharray="3,3"/>'
        f'<text x="{zero + 3:.1f}" y="9" font-size="9">upgrade start</text>'
    )
    legend, bottom = _legend(y + 34)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{bottom + 8}" role="img" '
        f'aria-label="{html.escape(label)}" font-family="system-ui,sans-serif">' + "".join(parts + legend) + "</svg>"
    )


def _node_band(evidence: RunEvidence, spans: list[StateSpan], node: str, scale: Scale, y: float) -> list[str]:
    parts = [f'<text x="4" y="{y + 15}" font-size="12">{html.escape(node)}</text>']
    if not spans:
        return parts + [f'<text x="{LEFT}" y="{y + 15}" font-size="11" fill="#c62828">no Node records</text>']
    for t in spans:
        x0, x1 = scale.x(evidence.offset_s(t.start_wall_ns)), scale.x(evidence.offset_s(t.end_wall_ns))
        state = t.state or "(none)"
        parts.append(
            f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" height="{BAND_H}" '
            f'fill="{STATE_COLOURS.get(t.state, "#bdbdbd")}" stroke="#fff" stroke-width="0.5">'
            f"<title>{html.escape(state)} from {evidence.offset_s(t.start_wall_ns):+.1f} s</title></rect>"
        )
        if x1 - x0 > 7 * len(state):
            parts.append(f'<text x="{x0 + 3:.1f}" y="{y + 15}" font-size="10">{html.escape(state)}</text>')
    return parts


def _eviction_marks(evidence: RunEvidence, removed: list[Eviction], scale: Scale, y: float) -> list[str]:
    parts = []
    for i, e in enumerate(removed):
        x = scale.x(evidence.offset_s(e.received_wall_ns))
        colour = "#9e9e9e" if e.allowed else "#c62828"
        label_y = y + BAND_H + 11 + 11 * (i % 2)
        parts.append(
            f'<path d="M{x:.1f},{y + BAND_H} l-5,-9 h10 z" fill="{colour}"><title>'
            f"{html.escape(e.line())}</title></path>"
            f'<text x="{x + 4:.1f}" y="{label_y}" font-size="10" fill="{colour}">'
            f"{html.escape(e.name)} {evidence.offset_s(e.received_wall_ns):+.0f}s</text>"
        )
    return parts


def _stall_mark(evidence: RunEvidence, cause: Cause, scale: Scale, y: float) -> list[str]:
    if cause.terminal_wall_ns is None:
        return []
    since_s, called_s = evidence.offset_s(cause.since_wall_ns), evidence.offset_s(cause.terminal_wall_ns)
    x0, x1 = scale.x(since_s), scale.x(called_s)
    title = html.escape(cause.line(since_s))
    return [
        f'<path d="M{x0:.1f},{y - 3} v-4 H{x1:.1f} v{BAND_H + 10}" fill="none" stroke="#6a1b9a" stroke-width="2">'
        f"<title>{title}</title></path>",
        f'<text x="{x1 + 4:.1f}" y="{y + BAND_H + 22}" font-size="10" fill="#6a1b9a">{html.escape(cause.reason)} '
        f"from {since_s:+.0f}s, will not clear: {called_s:+.0f}s<title>{title}</title></text>",
    ]


def _capacity_lane(dip: CapacityDip, scale: Scale, y: float) -> list[str]:
    """The node's allocatable GPUs as a step line: the dip while the driver manager has the device plugin
    paused, and the return once a new one registered."""
    top = max([v or 0 for _, v in dip.series] + [1])
    end_s = scale.t1_s

    def height(v: int | None) -> float:
        return y + CAPACITY_H - 2 - (CAPACITY_H - 8) * (v or 0) / top

    coords = []
    for (t, v), (t_next, _) in zip(dip.series, list(dip.series[1:]) + [(end_s, None)]):
        coords += [f"{scale.x(t):.1f},{height(v):.1f}", f"{scale.x(t_next):.1f},{height(v):.1f}"]
    note = f"gone {dip.gone_s:.0f} s" if dip.gone_s is not None else "no dip" if dip.left_s is None else "not back"
    return [
        f'<text x="4" y="{y + 12}" font-size="11">{html.escape(dip.node)} GPUs</text>',
        f'<text x="4" y="{y + 25}" font-size="9" fill="#6a1b9a">allocatable 0..{top}; {note}</text>',
        f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - RIGHT}" height="{CAPACITY_H}" fill="#fafafa" '
        f'stroke="#e0e0e0"><title>{html.escape(dip.line())}</title></rect>',
        f'<polyline points="{" ".join(coords)}" fill="none" stroke="#6a1b9a" stroke-width="1.5"/>',
    ]


def _probe_lane(evidence: RunEvidence, scale: Scale, y: float) -> list[str]:
    samples = []
    for p in evidence.probes:
        end = p.scheduled_wall_ns if p.scope is ProbeScope.POOL else p.running_wall_ns
        seconds = None if end is None else max(0.0, (end - p.created_wall_ns) / 1e9)
        samples.append((p, seconds))
    top = max([s for _, s in samples if s is not None] + [1.0])
    parts = [
        f'<text x="4" y="{y + 12}" font-size="12">probes</text>',
        f'<text x="4" y="{y + 26}" font-size="9" fill="#555">pool: queue delay</text>',
        f'<text x="4" y="{y + 38}" font-size="9" fill="#555">fleet: start latency</text>',
        f'<text x="4" y="{y + 50}" font-size="9" fill="#555">0..{top:.0f} s</text>',
        f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - RIGHT}" height="{LANE_H}" fill="#fafafa" stroke="#e0e0e0"/>',
    ]
    for p, seconds in samples:
        x = scale.x(evidence.offset_s(p.created_wall_ns))
        colour = "#1565c0" if p.scope is ProbeScope.POOL else "#6a1b9a"
        if seconds is None:
            parts.append(
                f'<text x="{x - 3:.1f}" y="{y + 10}" font-size="11" fill="#c62828">&#x2716;<title>'
                f"{html.escape(p.name)} never started</title></text>"
            )
            continue
        dot_y = y + LANE_H - 4 - (LANE_H - 12) * seconds / top
        parts.append(
            f'<circle cx="{x:.1f}" cy="{dot_y:.1f}" r="3" fill="{colour}"><title>{html.escape(p.name)} '
            f"({p.scope.value}): {seconds:.1f} s</title></circle>"
        )
    return parts


def _collective_lane(evidence: RunEvidence, scale: Scale, y: float) -> list[str]:
    """Each collective probe run as a bar from its start to its end, labelled with its bus bandwidth; a run
    that never completed (red) runs to the end of the recording."""
    parts = [
        f'<text x="4" y="{y + 12}" font-size="12">collective</text>',
        f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - RIGHT}" height="{COLLECTIVE_H}" fill="#fafafa" '
        f'stroke="#e0e0e0"/>',
    ]
    for run in evidence.collective:
        start_s = evidence.offset_s(run.started_wall_ns)
        end_s = scale.t1_s if run.ended_wall_ns is None else evidence.offset_s(run.ended_wall_ns)
        x0, x1 = scale.x(start_s), scale.x(end_s)
        colour = "#2e7d32" if run.busbw_gbps is not None else "#c62828"
        label = f"{run.busbw_gbps:.1f} GB/s" if run.busbw_gbps is not None else "no result"
        parts.append(
            f'<rect x="{x0:.1f}" y="{y + 4}" width="{max(x1 - x0, 2):.1f}" height="{COLLECTIVE_H - 8}" '
            f'fill="{colour}" opacity="0.7"><title>{html.escape(run.line())}</title></rect>'
            f'<text x="{x0:.1f}" y="{y + COLLECTIVE_H + 10}" font-size="10">{html.escape(run.when)}: '
            f"{html.escape(label)}</text>"
        )
    return parts


def _service_lane(evidence: RunEvidence, result: LadderResult, scale: Scale, y: float) -> list[str]:
    """Per upgrade phase: request rate (blue, scaled to the busiest phase) and error ratio (red, scaled to twice
    the threshold or the worst phase), each bar spanning the phase's window on the first pool node."""
    windows = {w.phase: w for w in result.phase_windows}
    shown = [(s, windows[s.phase]) for s in evidence.service_phases if s.phase in windows and s.requests]
    rates = {s.phase: s.requests / max((w.end_wall_ns - w.start_wall_ns) / 1e9, 1e-3) for s, w in shown}
    top_rate = max(list(rates.values()) + [1e-9])
    top_ratio = max([s.failures / s.requests for s, _ in shown] + [2 * result.thresholds["max_error_ratio"], 1e-9])
    parts = [
        f'<text x="4" y="{y + 12}" font-size="12">service load</text>',
        f'<text x="4" y="{y + 26}" font-size="9" fill="#1565c0">request rate (0..{top_rate:.1f}/s)</text>',
        f'<text x="4" y="{y + 38}" font-size="9" fill="#c62828">error ratio (0..{100 * top_ratio:.1f} %)</text>',
    ]
    for s, w in shown:
        x0, x1 = scale.x(evidence.offset_s(w.start_wall_ns)), scale.x(evidence.offset_s(w.end_wall_ns))
        width, ratio = max(x1 - x0 - 2, 1), s.failures / s.requests
        rate_h, error_h = (LANE_H - 14) * rates[s.phase] / top_rate, (LANE_H - 14) * ratio / top_ratio
        detail = (
            f"{s.phase.value}: {rates[s.phase]:.1f} requests/s, {100 * ratio:.2f} % errors "
            f"({s.failures}/{s.requests}), p99 {s.p99_s if s.p99_s is not None else '-'} s"
        )
        label = detail if width > 5.2 * len(detail) else s.phase.value if width > 6 * len(s.phase.value) else ""
        parts.append(
            f'<g><title>{html.escape(detail)}</title><rect x="{x0 + 1:.1f}" y="{y + LANE_H - rate_h:.1f}" '
            f'width="{width / 2:.1f}" height="{rate_h:.1f}" fill="#90caf9"/>'
            f'<rect x="{x0 + 1 + width / 2:.1f}" y="{y + LANE_H - error_h:.1f}" width="{width / 2:.1f}" '
            f'height="{error_h:.1f}" fill="#c62828" opacity="0.8"/>'
            f'<text x="{x0 + 3:.1f}" y="{y + 10}" font-size="9">{html.escape(label)}</text></g>'
        )
    return parts


def _rate_lane(evidence: RunEvidence, scale: Scale, y: float) -> list[str]:
    """Requests and errors per second as seen by the load generator, under the upgrade states."""
    points = [
        (evidence.offset_s(p.start_wall_ns + p.bucket_s * 5e8), p.requests_per_s, p.errors_per_s)
        for p in evidence.service_rate
    ]
    top = max([rate for _, rate, _ in points] + [1.0])

    def polyline(values: list[tuple[float, float]], colour: str) -> str:
        coords = " ".join(f"{scale.x(t):.1f},{y + LANE_H - 2 - (LANE_H - 14) * v / top:.1f}" for t, v in values)
        return f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.2"/>'

    return [
        f'<text x="4" y="{y + 12}" font-size="12">requests/s</text>',
        f'<text x="4" y="{y + 26}" font-size="9" fill="#1565c0">served (0..{top:.0f}/s)</text>',
        f'<text x="4" y="{y + 38}" font-size="9" fill="#c62828">failed</text>',
        f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - RIGHT}" height="{LANE_H}" fill="#fafafa" stroke="#e0e0e0"/>',
        polyline([(t, rate - errors) for t, rate, errors in points], "#1565c0"),
        polyline([(t, errors) for t, _, errors in points], "#c62828"),
    ]


def _axis(scale: Scale, y: float) -> list[str]:
    span = scale.t1_s - scale.t0_s
    step = next((s for s in (10, 30, 60, 120, 300, 600, 1200, 1800, 3600) if span / s <= 10), 7200)
    parts = [f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - RIGHT}" y2="{y}" stroke="#555"/>']
    for tick in range(math.ceil(scale.t0_s / step) * step, int(scale.t1_s) + 1, step):
        x = scale.x(tick)
        parts.append(
            f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#555"/>'
            f'<text x="{x - 8:.1f}" y="{y + 15}" font-size="10">{tick:+d}s</text>'
        )
    return parts


def _legend(y: float) -> tuple[list[str], float]:
    """The state colours, wrapped to the picture's width; returns the parts and the last line's y."""
    parts: list[str] = []
    x: float = LEFT
    for state, colour in STATE_COLOURS.items():
        if not state:
            continue
        parts.append(
            f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{x + 13}" y="{y}" font-size="9">{state}</text>'
        )
        x += 13 + 5.5 * len(state) + 10
        if x > WIDTH - 120:
            x, y = LEFT, y + 14
    return parts, y
