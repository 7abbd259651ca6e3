"""The canary's own subcommands: `gpucanary run` (the shipped gate under pytest), `preflight`, `evaluate`,
`verdict` and `cleanup`.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from pytest_gpucanary import target
from pytest_gpucanary.checks import run_id_rule
from pytest_gpucanary.command import ExitCode, add_knob_options, change_settings, helm, progress
from pytest_gpucanary.config import BY_NAME, KNOBS, Settings, flag
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.knobs import env_source


def add_run(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "run",
        help="Run the shipped canary gate (pytest canaries/ with the given --gpucanary-* options)",
        description="Runs pytest on the shipped gate. Every argument is passed to pytest, e.g. "
        f"{flag('policy')} PATH {flag('driver_version')} VERSION --junitxml report.xml; "
        "see `pytest --help` for all --gpucanary-* options.",
    )
    parser.set_defaults(handler=_cmd_run, takes_pytest_args=True)


def _cmd_run(args: argparse.Namespace) -> int:
    """pytest's own exit code: the session object turns a run that could not happen into 6."""
    import pytest

    from pytest_gpucanary.shipped import gate_pytest_args

    with gate_pytest_args(args.pytest_args) as pytest_args:
        return int(pytest.main(pytest_args))


def add_preflight(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "preflight",
        help="Check, read-only, that a canary run can happen: permissions, operator, pool, endpoints",
        description="Takes the run's --gpucanary-* options (and GPUCANARY_* environment) and checks, without "
        "changing anything: the inputs, every permission the run needs (SelfSubjectAccessReviews), "
        "the GPU Operator and its mode, the pool, the service URL and Prometheus with the series the "
        "metric checks need. One line per problem; exit 0 when a run can start, 6 when the cluster "
        "cannot run it, 4 when the input is wrong. Stdout: the findings as JSON.",
    )
    add_knob_options(parser, KNOBS)
    parser.add_argument(
        "-p",
        dest="plugins",
        metavar="NAME",
        action="append",
        default=[],
        help="Load a pytest plugin as `gpucanary run -p NAME` would (one whose pytest_gpucanary_make_pool hook "
        "gives the pool); installed plugins are loaded without it",
    )
    parser.set_defaults(handler=_cmd_preflight)


def _cmd_preflight(args: argparse.Namespace) -> ExitCode:
    import json

    from pytest_gpucanary.canary import preflight
    from pytest_gpucanary.canary.run import check_inputs

    settings = Settings.resolve(lambda knob: getattr(args, knob.name), env_source(os.environ))
    check_inputs(settings, fleet_chart=target.chart(settings))
    report = preflight.check(
        target.connect(settings),
        target.hooked_pool_provider(settings, [arg for name in args.plugins for arg in ("-p", name)]),
        target=settings.driver_version or "",
        prometheus_url=target.prometheus_url(settings),
        service_url=settings.service_url,
        longest_run_s=settings.longest_run_s(),
        pushgateway_url=settings.pushgateway_url,
    )
    for line in report.notes:
        progress(f"gpucanary: note: {line}")
    for line in report.exposure:
        progress(f"gpucanary: exposure: {line}")
    for line in report.unproven:
        progress(f"gpucanary: not proven: {line}")
    for problem in report.problems:
        progress(f"gpucanary: error: {problem.line}")
    print(
        json.dumps(
            {
                "ok": not report.problems,
                "mode": report.cluster.mode if report.cluster else None,
                "problems": [p.line for p in report.problems],
                "exposure": list(report.exposure),
                "notes": list(report.notes),
                "unproven": list(report.unproven),
            },
            indent=1,
        )
    )
    if not report.problems:
        return ExitCode.OK
    return ExitCode.USAGE if all(p.usage for p in report.problems) else ExitCode.ENVIRONMENT


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "evaluate",
        help="Judge a recorded run again from its report directory and rewrite its receipt",
        description="Reads REPORT_DIR/evidence.json, timeline.jsonl and load.jsonl, judges them with the run's "
        "thresholds "
        "(each overridable with its --gpucanary-* option) and rewrites the receipt. Offline: "
        "never contacts a cluster. Exit 0 when the gate passes, 1 when it does not.",
    )
    parser.add_argument("report_dir", metavar="REPORT_DIR", help="A run's directory, e.g. reports/<run-id>")
    add_knob_options(parser, (k for k in KNOBS if k.threshold))
    parser.set_defaults(handler=_cmd_evaluate)


def _cmd_evaluate(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.canary.outcome import replay

    overrides = {k.name: getattr(args, k.name) for k in KNOBS if k.threshold and getattr(args, k.name) is not None}
    outcome = replay(Path(args.report_dir), overrides)
    for verdict in outcome.result.verdicts:
        progress(f"{verdict.outcome.value:>12}  {verdict.summary}")
    print(outcome.receipt["json"])
    return ExitCode.OK if outcome.result.gate_passed else ExitCode.GATE_FAILED


VERDICT_KNOBS = ("policy", "driver_version", "kubeconfig", "context", "helm_chart", "helm_binary")


def add_verdict(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "verdict",
        help="Exit 0 only if a canary run recently passed for exactly this policy, target and release",
        description="Read-only. Finds the verdict of the last canary run that finished for this upgrade policy "
        "(the digest of the policy as applied, so a Helm values file and the ClusterPolicy it renders "
        "are one), this target driver and the GPU Operator release the cluster runs now, in ConfigMap "
        "gpucanary/gpucanary-verdict-<key>. Exit 0 when that run passed the gate and finished less "
        "than --max-age-h ago; 1 when there is none, it failed or it is older; 4 for bad input; 6 "
        "when the cluster cannot be read. Stdout: the verdict as JSON (null when none).",
    )
    add_knob_options(parser, (BY_NAME[name] for name in VERDICT_KNOBS))
    parser.add_argument(
        "--max-age-h",
        type=float,
        default=24.0,
        metavar="HOURS",
        help="Oldest passing verdict that counts, in hours (default 24)",
    )
    parser.set_defaults(handler=_cmd_verdict)


def _cmd_verdict(args: argparse.Namespace) -> ExitCode:
    import dataclasses
    import json

    from pytest_gpucanary.canary import publish
    from pytest_gpucanary.cluster import operator_release
    from pytest_gpucanary.policy.parse import load_policy
    from pytest_gpucanary.receipt.verdict import VerdictKey

    settings, policy_path, driver_to = change_settings(args, "a verdict is of one policy and one target driver")
    if not (args.max_age_h > 0 and math.isfinite(args.max_age_h)):
        raise ConfigError(f"--max-age-h={args.max_age_h} is not a positive number of hours", hint="e.g. --max-age-h=24")
    policy = load_policy(policy_path, helm=helm(settings))
    kube = target.connect(settings)
    key = VerdictKey.of(policy.to_cr(), driver_to, operator_release(kube))
    found = publish.read(kube, key)
    print(json.dumps(dataclasses.asdict(found) if found else None, indent=1))
    if why := publish.refusal(found, key, max_age_s=args.max_age_h * 3600):
        progress(f"gpucanary: hold: {why}")
        return ExitCode.GATE_FAILED
    assert found is not None  # refusal refuses when there is no verdict
    progress(f"gpucanary: proceed: {found.line()}")
    return ExitCode.OK


def add_cleanup(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("cleanup", help="Remove or restore everything canary runs left in a cluster")
    parser.add_argument("--kubeconfig", help="Kubeconfig of the cluster (default: the local fleet)")
    parser.add_argument("--context", help="Context in the kubeconfig")
    parser.add_argument(
        "--run-id",
        help="Only what this run left (default: every run whose Lease stopped "
        "renewing; cleanup watches each Lease for one duration, 60 s, to tell)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="With --run-id: take that run over without watching its Lease (its process is gone)",
    )
    parser.add_argument(
        "--wait-s",
        type=float,
        default=1200.0,
        metavar="SECONDS",
        help="Longest wait for a carved node's original driver before it is given back (default "
        "1200); a wait that runs out leaves the node held and exits 6",
    )
    parser.set_defaults(handler=_cmd_cleanup)


def _cmd_cleanup(args: argparse.Namespace) -> ExitCode:
    if args.run_id is not None and (problem := run_id_rule(args.run_id)):
        raise ConfigError(f"--run-id={args.run_id!r} {problem}", hint="give the id a canary run printed")
    if args.force and args.run_id is None:
        raise ConfigError("--force needs --run-id", hint="name the run whose process is surely gone")
    if not (args.wait_s > 0 and math.isfinite(args.wait_s)):
        raise ConfigError(f"--wait-s={args.wait_s} is not a positive number of seconds", hint="e.g. --wait-s=1200")
    from pytest_gpucanary.canary.cleanup import cleanup
    from pytest_gpucanary.kube import Kube

    kubeconfig = args.kubeconfig or target.test_bed().kubeconfig
    kube = Kube.connect(kubeconfig, context=args.context, option="--kubeconfig")
    result = cleanup(kube, run_id=args.run_id, force=args.force, wait_s=args.wait_s, report=progress)
    progress(f"cleanup: {result.restored} objects deleted or restored")
    if result.problems:
        progress(f"cleanup: {len(result.problems)} problems; what they name is still held or left as it is")
        return ExitCode.ENVIRONMENT
    return ExitCode.OK
