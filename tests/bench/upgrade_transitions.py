"""How long each upgrade-state transition took, from recorded timelines (reports/<run>/timeline.jsonl).

Usage: python tests/bench/upgrade_transitions.py reports/*/timeline.jsonl
Times are client receive times of the Node watch (wall clock, ns resolution; the operator's own
event timestamps have 1 s resolution). Prints one row per state with n and min/median/max seconds
spent in it, then the whole upgrade-required -> terminal duration, one row per terminal state (a
refused pod deletion fails within a second, and would drag a shared median down).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from pytest_gpucanary.canary import recorder
from pytest_gpucanary.ladder import timeline
import figures  # tests/bench/figures.py: this run's output, kept for the docs

def durations(path: Path) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per state, the seconds each upgrade cycle spent in it; per terminal state, each cycle's whole time."""
    records = recorder.load(path)
    spent: dict[str, list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(list)
    for node in sorted({r.name for r in records if r.kind == "Node" and r.name}):
        transitions = timeline.label_transitions(records, node, timeline.UPGRADE_STATE_LABEL)
        starts = [i for i, t in enumerate(transitions) if t.state == "upgrade-required"]
        for start in starts:
            cycle = transitions[start:]
            end = next((i for i, t in enumerate(cycle) if t.state in timeline.TERMINAL_STATES), None)
            if end is None:
                continue
            for here, nxt in zip(cycle[:end], cycle[1:end + 1]):
                spent[here.state].append((nxt.received_wall_ns - here.received_wall_ns) / 1e9)
            totals[cycle[end].state].append((cycle[end].received_wall_ns - cycle[0].received_wall_ns) / 1e9)
    return spent, totals


def collect(paths: list[Path]) -> dict[str, list[float]]:
    """Seconds per state over every timeline, in first-seen order, then `whole -> <terminal state>` rows."""
    per_state: dict[str, list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(list)
    for path in paths:
        spent, cycle_totals = durations(path)
        for state, seconds in spent.items():
            per_state[state].extend(seconds)
        for state, seconds in cycle_totals.items():
            totals[state].extend(seconds)
    return {**per_state, **{f"whole -> {state}": totals[state] for state in sorted(totals)}}


def table(per_state: dict[str, list[float]]) -> str:
    lines = [f"{'state (time spent in it)':<25} {'n':>3} {'min s':>7} {'median s':>9} {'max s':>7}"]
    for state, values in per_state.items():
        lines.append(f"{state:<25} {len(values):>3} {min(values):>7.1f} {statistics.median(values):>9.1f} "
                     f"{max(values):>7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    with figures.recorded(__file__):
        print(table(collect([Path(p) for p in sys.argv[1:]])))
