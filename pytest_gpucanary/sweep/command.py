"""`gpucanary plan-sweep`: the subcommand that plans a checkpoint-aware sweep from an inventory and costs it."""

from __future__ import annotations

import argparse
import sys

from pytest_gpucanary.command import ExitCode
from pytest_gpucanary.errors import ConfigError


def add_plan_sweep(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan-sweep",
        help="Plan a checkpoint-aware upgrade sweep",
        description="Plan a wave-by-wave upgrade that keeps old-version capacity for "
        "checkpoint restores, and cost it against a drain and a wait.",
    )
    parser.add_argument(
        "--inventory",
        metavar="PATH",
        help="YAML inventory of nodes and workloads (schema in fixtures/sweep/inventory.yaml)",
    )
    parser.add_argument(
        "--change",
        action="append",
        default=[],
        metavar="COMPONENT=VERSION",
        help="Target version of driver, cuda, engine or model; repeatable; replaces the inventory's change",
    )
    parser.add_argument(
        "--max-parallel", metavar="N", help="Nodes upgraded at once, 0 for no limit (default: the inventory's, else 1)"
    )
    parser.add_argument(
        "--max-unavailable",
        metavar="N|P%",
        help="Nodes unavailable at once, a count or a percentage rounded up (default: the inventory's, else 25%%)",
    )
    parser.add_argument(
        "--hold-back-gpus",
        metavar="N",
        help="GPUs per old version set kept on the old versions until the end (default: the inventory's, else 0)",
    )
    parser.add_argument("--json", action="store_true", help="Print the plan and the strategy costs as JSON")
    parser.add_argument("--html", metavar="PATH", help="Also write an offline HTML page of the plan")
    parser.set_defaults(handler=_cmd_plan_sweep)


def _cmd_plan_sweep(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.sweep import report as sweep_report
    from pytest_gpucanary.sweep.compare import compare_strategies
    from pytest_gpucanary.sweep.inventory import apply_overrides, load_inventory
    from pytest_gpucanary.sweep.model import Infeasible, NoSweepPlanError
    from pytest_gpucanary.sweep.plan import plan_or_infeasible

    if not args.inventory:
        raise ConfigError("plan-sweep needs --inventory PATH", hint="see fixtures/sweep/inventory.yaml")
    inventory = apply_overrides(
        load_inventory(args.inventory),
        change=args.change,
        max_parallel=args.max_parallel,
        max_unavailable=args.max_unavailable,
        hold_back_gpus=args.hold_back_gpus,
    )
    change = inventory.change
    assert change is not None  # apply_overrides refuses an inventory without a change
    outcome = plan_or_infeasible(inventory.fleet, change, inventory.limits)
    costs = compare_strategies(inventory.fleet, change, inventory.limits, outcome=outcome)
    if args.html:
        sweep_report.write_html(args.html, outcome, costs)
    print(sweep_report.render_json(outcome, costs) if args.json else sweep_report.render_table(outcome, costs))
    if isinstance(outcome, Infeasible):
        print(f"gpucanary: {NoSweepPlanError(outcome)}", file=sys.stderr)
        return ExitCode.GATE_FAILED
    return ExitCode.OK
