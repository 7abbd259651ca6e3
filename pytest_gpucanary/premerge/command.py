"""`gpucanary gate`: the subcommand that canaries base and head of a policy change and compares them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pytest_gpucanary import target
from pytest_gpucanary.command import ExitCode, add_knob_options, helm, progress
from pytest_gpucanary.config import KNOBS, Settings
from pytest_gpucanary.knobs import env_source


def add_gate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "gate",
        help="Canary base and head of a policy change and gate on head passing and being no worse",
        description="Lints and diffs HEAD against BASE, runs `gpucanary run` once per policy with the same "
        "--gpucanary-* run options, and compares: the gate passes when head passes and no stage, "
        "eviction count, service phase or upgrade time is worse than on base. The runs go in "
        "parallel when the cluster gives each NVIDIADriver its own upgradePolicy (GPU Operator "
        "v26.7+) and each run makes its own pool, else one after the other. Writes "
        "REPORTS_DIR/gate-<id>/gate.{md,json,html}, <id> from --gpucanary-run-id (the runs are <id>-base "
        "and <id>-head); stdout: the Markdown receipt's path.",
    )
    parser.add_argument(
        "--base",
        required=True,
        metavar="OLD",
        help="The policy before the change: a file or git:REF:PATH (read with git show)",
    )
    parser.add_argument(
        "--head", required=True, metavar="NEW", help="The policy after the change: a file or git:REF:PATH"
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="Run base and head one after the other even where the cluster allows both at once",
    )
    parser.set_defaults(handler=_cmd_gate, takes_pytest_args=True)


def _gate_settings(run_args: list[str]) -> Settings:
    """The run options the gate itself reads (cluster, pool, reports dir), resolved as a run would."""
    parser = argparse.ArgumentParser(add_help=False)
    add_knob_options(parser, KNOBS)
    known, _ = parser.parse_known_args(run_args)
    return Settings.resolve(lambda knob: getattr(known, knob.name), env_source(os.environ))


def _cmd_gate(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.canary.run import new_run_id
    from pytest_gpucanary.cluster import discover
    from pytest_gpucanary.premerge import gate

    settings = _gate_settings(args.pytest_args)
    planned = gate.plan(
        base=args.base,
        head=args.head,
        run_args=args.pytest_args,
        reports_dir=Path(settings.reports_dir),
        gate_id=settings.run_id or new_run_id(),
        helm=helm(settings),
    )
    env, bed = dict(os.environ), None
    if settings.kubeconfig is None:
        bed = target.test_bed()
        bed.up(progress=progress)  # once here: two runs starting it at once would race
        env["GPUCANARY_FLEET_KEEP"] = "1"
    try:
        cluster = discover(target.connect(settings))
        per_run_pool = getattr(target.hooked_pool_provider(settings, args.pytest_args), "fresh_per_run", False)
        parallel = cluster.nvidiadriver_mode and cluster.per_driver_policy and per_run_pool and not args.sequential
        if not parallel and not args.sequential:
            progress(
                f"gate: {cluster.mode} mode, per-driver upgradePolicy {cluster.per_driver_policy}, "
                f"pool made per run {per_run_pool}: base and head run one after the other"
            )
        outcome = gate.gate(planned, run_args=args.pytest_args, parallel=parallel, env=env, progress=progress)
    finally:
        if bed is not None and not settings.fleet_keep:
            bed.down(progress=progress)
    if outcome.comparison is None:
        failed = {label: code for label, code in outcome.exit_codes.items() if code not in (0, 1)}
        progress(
            f"gpucanary: error: the {' and '.join(failed)} run could not happen (exit "
            f"{', '.join(map(str, failed.values()))}); see {outcome.gate_dir}/<side>.log"
        )
        if ExitCode.INTERRUPTED in failed.values():
            return ExitCode.INTERRUPTED
        return ExitCode.USAGE if set(failed.values()) == {ExitCode.USAGE} else ExitCode.ENVIRONMENT
    for regression in outcome.comparison.regressions:
        progress(f"gate: {regression.rule}: {regression.line}")
    progress(f"gate: {outcome.comparison.headline()}")
    print(outcome.receipt["markdown"])
    return ExitCode.OK if outcome.comparison.gate_passed else ExitCode.GATE_FAILED
