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

from pytest_gpucanary import recorder, timeline


def durations(path: Path) -> tuple[dict[str, float], float | None]:
    records = recorder.load(path)
    nodes = {r.name for r in records if r.kind == "Node" and r.name}
    spent: dict[str, float] = {}
    total = None
    for node in nodes:
        transitions = timeline.label_transitions(records, node, timeline.UPGRADE_STATE_LABEL)
        states = [t.state for t in transitions]
        if "upgrade-required" not in states:
            continue
        start = states.index("upgrade-required")
        cycle = transitions[start:]
        for here, nxt in zip(cycle, cycle[1:]):
            spent[here.state] = (nxt.received_wall_ns - here.received_wall_ns) / 1e9
        if cycle[-1].state in timeline.TERMINAL_STATES:
            total = (cycle[-1].received_wall_ns - cycle[0].received_wall_ns) / 1e9
    return spent, total


def main(paths: list[str]) -> None:
    per_state: dict[str, list[float]] = defaultdict(list)
    totals = []
    for path in paths:
        spent, total = durations(Path(path))
        for state, seconds in spent.items():
            per_state[state].append(seconds)
        if total is not None:
            totals.append(total)
    print(f"{'state':<24} {'n':>3} {'min s':>7} {'median s':>9} {'max s':>7}")
    for state, values in per_state.items():
        print(f"{state:<24} {len(values):>3} {min(values):>7.1f} {statistics.median(values):>9.1f} {max(values):>7.1f}")
    if totals:
        print(f"{'whole upgrade':<24} {len(totals):>3} {min(totals):>7.1f} {statistics.median(totals):>9.1f} "
              f"{max(totals):>7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
