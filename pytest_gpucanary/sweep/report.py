"""Renders a sweep plan (or why there is none) with the strategy costs: a plain table, JSON, offline HTML.

Takes the records `sweep.plan` and `sweep.compare` return; computes nothing about the sweep itself.
All times are the plan clock: seconds from the first wave's start.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.sweep.compare import StrategyCost
from pytest_gpucanary.sweep.model import Infeasible, MoveKind, SweepPlan, describe_shortfall

Outcome = SweepPlan | Infeasible


def _heading(outcome: Outcome) -> str:
    limits = outcome.limits
    return (
        f"sweep {outcome.change.target.label()} (node upgrade {outcome.change.node_upgrade_s:g} s); "
        f"max parallel {limits.max_parallel or 'unlimited'}, max unavailable {limits.max_unavailable}, "
        f"hold back {limits.hold_back_gpus} GPUs"
    )


def _hours(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _costs_lines(costs: tuple[StrategyCost, ...]) -> list[str]:
    lines = [
        "",
        f"{'strategy':<20} {'calendar_s':>11} {'lost_gpu_h':>11} {'cold_starts':>11} "
        f"{'idle_gpu_h':>11} {'downtime_gpu_h':>15}  note",
    ]
    for c in costs:
        calendar = "never" if c.calendar_s is None else f"{c.calendar_s:.0f}"
        lines.append(
            f"{c.strategy.value:<20} {calendar:>11} {_hours(c.lost_gpu_h):>11} {c.cold_starts:>11} "
            f"{_hours(c.idle_gpu_h):>11} {_hours(c.downtime_gpu_h):>15}  {c.note}".rstrip()
        )
    return lines


def render_table(outcome: Outcome, costs: tuple[StrategyCost, ...]) -> str:
    """Plain text: waves, every move, totals, then the three strategies side by side."""
    if isinstance(outcome, Infeasible):
        return "\n".join([_heading(outcome), *_infeasible_lines(outcome), *_costs_lines(costs)])
    plan = outcome
    lines = [
        _heading(plan),
        "",
        f"{'wave':>4} {'start_s':>9} {'nodes':>5} {'restores':>8} {'cold_starts':>11} "
        f"{'old_gpus_left':>13} {'old_gpus_used':>13}  nodes",
    ]
    for w in plan.waves:
        cold = sum(m.kind is MoveKind.COLD_START for m in w.moves)
        lines.append(
            f"{w.index:>4} {w.start_s:>9.0f} {len(w.nodes):>5} {len(w.moves) - cold:>8} {cold:>11} "
            f"{w.old_gpus_left:>13} {w.old_gpus_used:>13}  {', '.join(w.nodes)}"
        )
    lines += ["", f"{'wave':>4} {'workload':<28} {'move':<10} {'from':<16} {'to':<16} {'stop_s':>8} {'ready_s':>8}"]
    for w in plan.waves:
        for m in w.moves:
            lines.append(
                f"{m.wave:>4} {m.workload:<28} {m.kind.value:<10} {m.from_node:<16} {m.to_node:<16} "
                f"{m.stop_s:>8.0f} {m.ready_s:>8.0f}"
            )
    lines += [
        "",
        f"{len(plan.waves)} waves of <= {plan.wave_size} nodes; {plan.restores} restores, "
        f"{plan.cold_starts} cold starts; duration {plan.duration_s:.0f} s; lost {plan.lost_gpu_h:.1f} "
        f"GPU-h, idle {plan.idle_gpu_h:.1f} GPU-h, downtime {plan.downtime_gpu_h:.1f} GPU-h",
    ]
    return "\n".join(lines + _costs_lines(costs))


def _infeasible_lines(infeasible: Infeasible) -> list[str]:
    lines = ["", "no plan:"]
    lines += [f"  {describe_shortfall(s)}" for s in infeasible.shortfalls]
    fix = infeasible.hold_back_fix_gpus
    lines.append(
        f"  fix: hold back {fix} GPUs per old version set (--hold-back-gpus {fix})"
        if fix is not None
        else "  fix: none by holding back; add capacity of that GPU model or lower the load"
    )
    return lines


def render_json(outcome: Outcome, costs: tuple[StrategyCost, ...]) -> str:
    key = "infeasible" if isinstance(outcome, Infeasible) else "plan"
    document = {key: dataclasses.asdict(outcome), "strategies": [dataclasses.asdict(c) for c in costs]}
    return json.dumps(document, indent=1)


def write_html(path: str | Path, outcome: Outcome, costs: tuple[StrategyCost, ...]) -> None:
    try:
        Path(path).write_text(render_html(outcome, costs), encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot write --html {str(path)!r}: {err.strerror}", hint="pick a writable path") from err


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpucanary sweep plan</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}
.bad{{color:#b00}}</style></head><body>
<h1>Checkpoint-aware sweep</h1><p>{heading}</p>{body}
<h2>Strategies on the same fleet</h2>{costs}
<p>Times are the plan clock (seconds from the first wave). Idle counts upgrading nodes, restores and cold
starts, and (wait-for-completion) GPUs stranded on draining nodes.</p></body></html>
"""


def render_html(outcome: Outcome, costs: tuple[StrategyCost, ...]) -> str:
    """One self-contained page: inline SVG of the waves and old capacity, the wave table, the strategies."""
    if isinstance(outcome, Infeasible):
        items = "".join(f"<li>{html.escape(describe_shortfall(s))}</li>" for s in outcome.shortfalls)
        body = f'<h2 class="bad">No plan</h2><ul>{items}</ul><p>{html.escape(_infeasible_lines(outcome)[-1])}</p>'
    else:
        body = _waves_svg(outcome) + _waves_table(outcome)
    return PAGE.format(heading=html.escape(_heading(outcome)), body=body, costs=_costs_table(costs))


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _costs_table(costs: tuple[StrategyCost, ...]) -> str:
    rows = [
        [
            c.strategy.value,
            "never" if c.calendar_s is None else f"{c.calendar_s:.0f}",
            _hours(c.lost_gpu_h),
            str(c.cold_starts),
            _hours(c.idle_gpu_h),
            _hours(c.downtime_gpu_h),
            c.note,
        ]
        for c in costs
    ]
    return _table(["strategy", "calendar_s", "lost_gpu_h", "cold_starts", "idle_gpu_h", "downtime_gpu_h", "note"], rows)


def _waves_table(plan: SweepPlan) -> str:
    rows = []
    for w in plan.waves:
        cold = sum(m.kind is MoveKind.COLD_START for m in w.moves)
        rows.append(
            [
                str(w.index),
                f"{w.start_s:.0f}",
                ", ".join(w.nodes),
                str(len(w.moves) - cold),
                str(cold),
                str(w.old_gpus_left),
                str(w.old_gpus_used),
            ]
        )
    return "<h2>Waves</h2>" + _table(
        ["wave", "start_s", "nodes", "restores", "cold_starts", "old_gpus_left", "old_gpus_used"], rows
    )


def _waves_svg(plan: SweepPlan) -> str:
    """Top: each wave as a span on the plan clock. Bottom: old-version GPUs left after it, and how many are used."""
    width, left, top_h, bars_h = 760, 50, 40, 180
    plot = width - left - 10
    end = max(plan.duration_s, 1.0)
    most = max([w.old_gpus_left for w in plan.waves] + [1])
    slot = plot / max(len(plan.waves), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top_h + bars_h + 40}" '
        f'role="img" aria-label="waves and old-version capacity left">',
        f'<text x="0" y="14" font-size="11">waves (plan clock, 0-{end:.0f} s)</text>',
    ]
    for w in plan.waves:
        x, span = left + plot * w.start_s / end, max(plot * (w.end_s - w.start_s) / end, 1.0)
        fill = "#4a7bd0" if w.index % 2 else "#8fb0e8"
        parts.append(
            f'<rect x="{x:.1f}" y="20" width="{span:.1f}" height="14" fill="{fill}">'
            f"<title>wave {w.index}: {html.escape(', '.join(w.nodes[:8]))}</title></rect>"
        )
    base = top_h + bars_h
    parts.append(f'<text x="0" y="{top_h + 12}" font-size="11">old-version GPUs left (max {most})</text>')
    for i, w in enumerate(plan.waves):
        x, bar = left + i * slot, max(slot * 0.8, 0.5)
        total_h, used_h = (bars_h - 20) * w.old_gpus_left / most, (bars_h - 20) * w.old_gpus_used / most
        parts.append(
            f'<rect x="{x:.1f}" y="{base - total_h:.1f}" width="{bar:.1f}" height="{total_h:.1f}" '
            f'fill="#cfd8e6"><title>after wave {w.index}: {w.old_gpus_left} left, '
            f"{w.old_gpus_used} used</title></rect>"
        )
        parts.append(
            f'<rect x="{x:.1f}" y="{base - used_h:.1f}" width="{bar:.1f}" height="{used_h:.1f}" fill="#d07a4a"/>'
        )
    parts.append(f'<line x1="{left}" y1="{base}" x2="{width - 10}" y2="{base}" stroke="#555"/>')
    step = max(1, len(plan.waves) // 20)  # at most ~20 wave labels under the bars
    parts += [
        f'<text x="{left + i * slot:.1f}" y="{base + 14}" font-size="10">{w.index}</text>'
        for i, w in enumerate(plan.waves)
        if i % step == 0 or i == len(plan.waves) - 1
    ]
    parts.append(
        f'<text x="0" y="{base + 14}" font-size="10">wave</text>'
        f'<text x="{left}" y="{base + 32}" font-size="11" fill="#d07a4a">used by running work</text>'
        f'<text x="{left + 150}" y="{base + 32}" font-size="11" fill="#8a99b0">standing, free</text></svg>'
    )
    return "".join(parts)
