"""The `gpucanary` command: one error boundary, subcommands from a table, exit codes in one enum."""

from __future__ import annotations

import argparse
import enum
import os
import sys
from pathlib import Path
from typing import Callable

from pytest_gpucanary.config import KNOBS, flag, run_id_rule
from pytest_gpucanary.errors import ConfigError, GpucanaryError


class ExitCode(enum.IntEnum):
    OK = 0
    GATE_FAILED = 1
    INTERRUPTED = 2
    INTERNAL = 3
    USAGE = 4
    NOTHING_RAN = 5
    ENVIRONMENT = 6


EXIT_CODES_HELP = ", ".join(f"{code.value} {code.name.lower().replace('_', ' ')}" for code in ExitCode)


def _add_fleet(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("fleet", help="Run the local GPU fleet (real control plane, KWOK GPU nodes)")
    actions = parser.add_subparsers(dest="fleet_action", required=True)
    up = actions.add_parser("up", help="Build (if needed) and start the fleet; idempotent")
    up.add_argument("--gpu-nodes", type=int, default=None,
                    help="Number of simulated GPU nodes (env GPUCANARY_FLEET_GPU_NODES, default 4)")
    actions.add_parser("status", help="Print the kubeconfig path and the state of each component")
    actions.add_parser("down", help="Stop every fleet process and free its ports")
    parser.set_defaults(handler=_cmd_fleet)


def _cmd_fleet(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.fleet import Fleet

    fleet = Fleet.from_env()
    if args.fleet_action == "up":
        if args.gpu_nodes is not None:
            fleet = fleet.with_gpu_nodes(args.gpu_nodes)
        fleet.up(progress=_progress)
        print(fleet.kubeconfig)
    elif args.fleet_action == "status":
        status = fleet.status()
        print(f"kubeconfig: {fleet.kubeconfig}")
        for name, state in status.items():
            print(f"{name:<24} {state}")
        if "nodes" not in status:
            return ExitCode.ENVIRONMENT
        print(f"\n{'NODE':<14} {'READY':<6} {'GPUS':<5} {'PRODUCT':<24} UPGRADE STATE")
        for row in fleet.nodes():
            print(f"{row['name']:<14} {row['ready']:<6} {row['gpus']:<5} {row['product']:<24} {row['upgrade']}")
    else:
        fleet.down(progress=_progress)
    return ExitCode.OK


def _add_plan_sweep(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("plan-sweep", help="Plan a checkpoint-aware upgrade sweep",
                            description="Plan a wave-by-wave upgrade that keeps old-version capacity for "
                                        "checkpoint restores, and cost it against a drain and a wait.")
    parser.add_argument("--inventory", metavar="PATH",
                        help="YAML inventory of nodes and workloads (schema in fixtures/sweep/inventory.yaml)")
    parser.add_argument("--change", action="append", default=[], metavar="COMPONENT=VERSION",
                        help="Target version of driver, cuda, engine or model; repeatable; replaces the "
                             "inventory's change")
    parser.add_argument("--max-parallel", metavar="N",
                        help="Nodes upgraded at once, 0 for no limit (default: the inventory's, else 1)")
    parser.add_argument("--max-unavailable", metavar="N|P%",
                        help="Nodes unavailable at once, a count or a percentage rounded up "
                             "(default: the inventory's, else 25%%)")
    parser.add_argument("--hold-back-gpus", metavar="N",
                        help="GPUs per old version set kept on the old versions until the end "
                             "(default: the inventory's, else 0)")
    parser.add_argument("--json", action="store_true", help="Print the plan and the strategy costs as JSON")
    parser.add_argument("--html", metavar="PATH", help="Also write an offline HTML page of the plan")
    parser.set_defaults(handler=_cmd_plan_sweep)


def _cmd_plan_sweep(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.sweep import report as sweep_report
    from pytest_gpucanary.sweep.model import Infeasible, NoSweepPlanError
    from pytest_gpucanary.sweep.compare import compare_strategies
    from pytest_gpucanary.sweep.inventory import apply_overrides, load_inventory
    from pytest_gpucanary.sweep.plan import plan_or_infeasible

    if not args.inventory:
        raise ConfigError("plan-sweep needs --inventory PATH", hint="see fixtures/sweep/inventory.yaml")
    inventory = apply_overrides(load_inventory(args.inventory), change=args.change, max_parallel=args.max_parallel,
                                max_unavailable=args.max_unavailable, hold_back_gpus=args.hold_back_gpus)
    outcome = plan_or_infeasible(inventory.fleet, inventory.change, inventory.limits)
    costs = compare_strategies(inventory.fleet, inventory.change, inventory.limits, outcome=outcome)
    if args.html:
        sweep_report.write_html(args.html, outcome, costs)
    print(sweep_report.render_json(outcome, costs) if args.json else sweep_report.render_table(outcome, costs))
    if isinstance(outcome, Infeasible):
        print(f"gpucanary: {NoSweepPlanError(outcome)}", file=sys.stderr)
        return ExitCode.GATE_FAILED
    return ExitCode.OK


def _add_run(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "run", help="Run the shipped canary gate (pytest canaries/ with the given --gpucanary-* options)",
        description="Runs pytest on the shipped gate. Every argument is passed to pytest, e.g. "
                    f"{flag('policy')} PATH {flag('driver_version')} VERSION --junitxml report.xml; "
                    "see `pytest --help` for all --gpucanary-* options.")
    parser.set_defaults(handler=_cmd_run, takes_pytest_args=True)


def _cmd_run(args: argparse.Namespace) -> int:
    """pytest's own exit code: the session object turns a run that could not happen into 6."""
    import pytest

    from pytest_gpucanary.config import CANARIES

    # the plugin is imported already (this module is in its package), so pytest cannot rewrite it
    return int(pytest.main([str(CANARIES), "-p", "no:locust", "-W", "ignore::pytest.PytestAssertRewriteWarning",
                            *args.pytest_args]))


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "evaluate", help="Judge a recorded run again from its report directory and rewrite its receipt",
        description="Reads REPORT_DIR/evidence.json and timeline.jsonl, judges them with the run's thresholds "
                    "(each overridable with its --gpucanary-* option) and rewrites the receipt. Offline: "
                    "never contacts a cluster. Exit 0 when the gate passes, 1 when it does not.")
    parser.add_argument("report_dir", metavar="REPORT_DIR", help="A run's directory, e.g. reports/<run-id>")
    for knob in (k for k in KNOBS if k.threshold):
        kwargs = {"action": "store_const", "const": "true"} if knob.type is bool else {"metavar": knob.name.upper()}
        parser.add_argument(knob.flag, dest=knob.name, default=None, help=knob.help, **kwargs)
    parser.set_defaults(handler=_cmd_evaluate)


def _cmd_evaluate(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.run import replay

    overrides = {k.name: getattr(args, k.name) for k in KNOBS if k.threshold and getattr(args, k.name) is not None}
    outcome = replay(Path(args.report_dir), overrides)
    for verdict in outcome.result.verdicts:
        _progress(f"{verdict.outcome.value:>12}  {verdict.summary}")
    print(outcome.receipt["json"])
    return ExitCode.OK if outcome.result.gate_passed else ExitCode.GATE_FAILED


def _add_cleanup(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("cleanup", help="Remove or restore everything canary runs left in a cluster")
    parser.add_argument("--kubeconfig", help="Kubeconfig of the cluster (default: the local fleet)")
    parser.add_argument("--context", help="Context in the kubeconfig")
    parser.add_argument("--run-id", help="Only what this run left (default: every run)")
    parser.set_defaults(handler=_cmd_cleanup)


def _cmd_cleanup(args: argparse.Namespace) -> ExitCode:
    if args.run_id is not None and (problem := run_id_rule(args.run_id)):
        raise ConfigError(f"--run-id={args.run_id!r} {problem}", hint="give the id a canary run printed")
    from pytest_gpucanary.cleanup import cleanup
    from pytest_gpucanary.fleet import Fleet
    from pytest_gpucanary.kube import Kube

    kube = Kube.connect(args.kubeconfig or Fleet.from_env().kubeconfig, context=args.context, option="--kubeconfig")
    count = cleanup(kube, run_id=args.run_id, report=_progress)
    _progress(f"cleanup: {count} objects deleted or restored")
    return ExitCode.OK


def _add_lint(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("lint", help="Validate an upgrade policy and predict its blast radius",
                            description="Validate a ClusterPolicy, NVIDIADriver or gpu-operator Helm values file "
                                        "and print one finding per line: severity code path: message. "
                                        "Exit 1 if any finding is an error.")
    parser.add_argument("policy", metavar="POLICY", help="Policy YAML: ClusterPolicy, NVIDIADriver or Helm values")
    parser.add_argument("--against", metavar="OLD_POLICY",
                        help="Also print the knobs changed since OLD_POLICY and the findings each change adds (+) "
                             "or removes (-)")
    parser.add_argument("--json", action="store_true", help="Print the findings (and changes) as JSON")
    parser.set_defaults(handler=_cmd_lint)


def _cmd_lint(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.policy import lint as policy_lint
    from pytest_gpucanary.policy.parse import load_policy

    policy = load_policy(args.policy)
    changes = policy_lint.diff_policies(load_policy(args.against), policy) if args.against else None
    findings = policy_lint.lint_policy(policy)
    output = (policy_lint.render_json if args.json else policy_lint.render_lines)(findings, changes)
    if output:
        print(output)
    return ExitCode.GATE_FAILED if policy_lint.has_errors(findings) else ExitCode.OK


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_fleet, _add_run, _add_evaluate, _add_cleanup,
                                                                       _add_plan_sweep, _add_lint)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpucanary",
        description="Canary a GPU Operator driver upgrade policy on a disposable node pool.",
        epilog=f"Exit codes: {EXIT_CODES_HELP}.",
    )
    parser.add_argument("--traceback", action="store_true", help="Show the traceback of expected errors too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_pytest_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = extra
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("gpucanary: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except GpucanaryError as err:
        if args.traceback or os.environ.get("GPUCANARY_TRACEBACK"):
            raise
        print(f"gpucanary: error: {err}", file=sys.stderr)
        return ExitCode.USAGE if isinstance(err, ConfigError) else ExitCode.ENVIRONMENT


if __name__ == "__main__":
    sys.exit(main())
