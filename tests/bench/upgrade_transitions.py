"""How long each upgrade-state transition took, from recorded timelines (reports/<run>/timeline.jsonl).

Usage: python tests/bench/upgrade_transitions.py reports/*/timeline.jsonl
Times are client receive times of the Node watch (wall clock, ns resolution; the operator's own
event timestamps have 1 s resolution). Prints one row per state with min/median/max seconds spent
in it, and the whole upgrade-required -> terminal duration.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from pytest_gpucanary import recorder
from pytest_gpucanary.ladder import timeline


def durations(path: Path) -> tuple[dict[str, list[float]], list[float]]:
    """Per state, the seconds each upgrade cycle spent in it; and each cycle's required -> terminal time."""
    records = recorder.load(path)
    spent: dict[str, list[float]] = defaultdict(list)
    totals = []
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
            totals.append((cycle[end].received_wall_ns - cycle[0].received_wall_ns) / 1e9)
    return spent, totals


def main(paths: list[str]) -> None:
    per_state: dict[str, list[float]] = defaultdict(list)
    totals = []
    for path in paths:
        spent, cycle_totals = durations(Path(path))
        for state, seconds in spent.items():
            per_state[state].extend(seconds)
        totals.extend(cycle_totals)
    print(f"{'state (time spent in it)':<24} {'n':>3} {'min s':>7} {'median s':>9} {'max s':>7}")
    for state, values in per_state.items():
        print(f"{state:<24} {len(values):>3} {min(values):>7.1f} {statistics.median(values):>9.1f} {max(values):>7.1f}")
    if totals:
        print(f"{'whole upgrade':<24} {len(totals):>3} {min(totals):>7.1f} {statistics.median(totals):>9.1f} "
              f"{max(totals):>7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
