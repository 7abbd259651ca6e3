"""The `gpucanary` command: one error boundary, subcommands from a table, exit codes in one enum."""

from __future__ import annotations

import argparse
import enum
import math
import os
import sys
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucanary import target
from pytest_gpucanary.config import BY_NAME, KNOBS, Knob, Settings, env_source, flag, run_id_rule
from pytest_gpucanary.errors import ConfigError, GpucanaryError

if TYPE_CHECKING:
    from pytest_gpucanary.policy.helm import HelmChart


class ExitCode(enum.IntEnum):
    OK = 0
    GATE_FAILED = 1
    INTERRUPTED = 2
    INTERNAL = 3
    USAGE = 4
    NOTHING_RAN = 5
    ENVIRONMENT = 6


COMMANDS_GROUP = "gpucanary.commands"  # entry points: (subparsers) -> None, adding subcommands
EXIT_CODES_HELP = ", ".join(f"{code.value} {code.name.lower().replace('_', ' ')}" for code in ExitCode)


def _add_plan_sweep(sub: argparse._SubParsersAction) -> None:
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


def _add_run(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "run",
        help="Run the shipped canary gate (pytest canaries/ with the given --gpucanary-* options)",
        description="Runs pytest on the shipped gate. Every argument is passed to pytest, e.g. "
        f"{flag('policy')} PATH {flag('driver_version')} VERSION --junitxml report.xml; "
        "see `pytest --help` for all --gpucanary-* options.",
    )
    parser.set_defaults(handler=_cmd_run, takes_pytest_args=True)


GATE_INI = "gate-pytest.ini"


def gate_pytest_args(pytest_args: list[str], *, ini: Path) -> list[str]:
    """The shipped gate with its own configuration (`ini`, shipped in the package), rootdir and conftest
    boundary, never the caller's, whatever the current directory."""
    from pytest_gpucanary.config import CANARIES

    # the plugin is imported already (this module is in its package), so pytest cannot rewrite it
    return [
        "-c",
        str(ini),
        f"--rootdir={CANARIES}",
        f"--confcutdir={CANARIES}",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:locust",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        str(CANARIES),
        *pytest_args,
    ]


def _cmd_run(args: argparse.Namespace) -> int:
    """pytest's own exit code: the session object turns a run that could not happen into 6."""
    from importlib import resources

    import pytest

    with resources.as_file(resources.files("pytest_gpucanary") / GATE_INI) as ini:
        return int(pytest.main(gate_pytest_args(args.pytest_args, ini=ini)))


def add_knob_options(parser: argparse.ArgumentParser, knobs: Iterable[Knob]) -> None:
    """Each knob as its --gpucanary-* option, None when not given (so the environment and defaults resolve it)."""
    for knob in knobs:
        kwargs: dict[str, Any] = (
            {"action": "store_const", "const": "true"} if knob.type is bool else {"metavar": knob.name.upper()}
        )
        parser.add_argument(knob.flag, dest=knob.name, default=None, help=knob.help, **kwargs)


def _add_preflight(sub: argparse._SubParsersAction) -> None:
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
    parser.set_defaults(handler=_cmd_preflight)


def _cmd_preflight(args: argparse.Namespace) -> ExitCode:
    import json

    from pytest_gpucanary.canary import preflight
    from pytest_gpucanary.canary.run import check_inputs

    settings = Settings.resolve(lambda knob: getattr(args, knob.name), env_source(os.environ))
    check_inputs(settings, fleet_chart=target.chart(settings))
    report = preflight.check(
        target.connect(settings),
        target.pool_provider(settings),
        target=settings.driver_version or "",
        prometheus_url=target.prometheus_url(settings),
        service_url=settings.service_url,
        longest_run_s=settings.longest_run_s(),
        pushgateway_url=settings.pushgateway_url,
    )
    for line in report.notes:
        _progress(f"gpucanary: note: {line}")
    for line in report.exposure:
        _progress(f"gpucanary: exposure: {line}")
    for line in report.unproven:
        _progress(f"gpucanary: not proven: {line}")
    for problem in report.problems:
        _progress(f"gpucanary: error: {problem.line}")
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


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "evaluate",
        help="Judge a recorded run again from its report directory and rewrite its receipt",
        description="Reads REPORT_DIR/evidence.json and timeline.jsonl, judges them with the run's thresholds "
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
        _progress(f"{verdict.outcome.value:>12}  {verdict.summary}")
    print(outcome.receipt["json"])
    return ExitCode.OK if outcome.result.gate_passed else ExitCode.GATE_FAILED


VERDICT_KNOBS = ("policy", "driver_version", "kubeconfig", "context", "helm_chart", "helm_binary")


def _change_settings(args: argparse.Namespace, what: str) -> tuple[Settings, Path, str]:
    """The settings of a command about one change, with its policy and target driver, both given."""
    settings = Settings.resolve(lambda knob: getattr(args, knob.name, None), env_source(os.environ))
    if settings.policy is None or not settings.driver_version:
        raise ConfigError(
            what, hint=f"pass {flag('policy')} PATH and {flag('driver_version')} VERSION, as the canary run had"
        )
    return settings, settings.policy, settings.driver_version


def _add_verdict(sub: argparse._SubParsersAction) -> None:
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

    settings, policy_path, driver_to = _change_settings(args, "a verdict is of one policy and one target driver")
    if not (args.max_age_h > 0 and math.isfinite(args.max_age_h)):
        raise ConfigError(f"--max-age-h={args.max_age_h} is not a positive number of hours", hint="e.g. --max-age-h=24")
    policy = load_policy(policy_path, helm=_helm(settings))
    kube = target.connect(settings)
    key = VerdictKey.of(policy.to_cr(), driver_to, operator_release(kube))
    found = publish.read(kube, key)
    print(json.dumps(dataclasses.asdict(found) if found else None, indent=1))
    if why := publish.refusal(found, key, max_age_s=args.max_age_h * 3600):
        _progress(f"gpucanary: hold: {why}")
        return ExitCode.GATE_FAILED
    assert found is not None  # refusal refuses when there is no verdict
    _progress(f"gpucanary: proceed: {found.line()}")
    return ExitCode.OK


WIDEN_KNOBS = (
    *VERDICT_KNOBS,
    "allowed_evictions",
    "prometheus_url",
    "reports_dir",
    "probe",
    "probe_interval_s",
    "max_queue_delay_s",
    "max_start_latency_s",
    "min_probe_samples",
    "image_registry",
    "probe_image",
)


def _add_widen(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "widen",
        help="Roll a change the canary passed out to the rest of the fleet, in waves",
        description="Needs the passing verdict `gpucanary verdict` would find for this policy, target and release; "
        "refuses before any write without one. Holds every node of the NVIDIADriver (or, in ClusterPolicy "
        "mode, every driver node) with the operator's skip label, writes the target version and the "
        "policy, then releases one wave at a time. Each wave must reach upgrade-done on the target driver "
        "within --wave-budget-s and stay so for --soak-s, removing no pod the allowed-evictions rule does "
        "not allow, while customer start probes across the fleet keep within their queue delay and start "
        "latency limits; a failed wave halts the sweep with every later node held on its old driver. The "
        "sweep's state is in ConfigMap gpucanary/gpucanary-widen-<key>. Exit 0 when every wave passed; 1 "
        "when a wave failed or the verdict refused; 2 interrupted (the holds stay: --resume, or "
        "`gpucanary cleanup --run-id` rolls it back); 4 bad input; 6 the cluster refused.",
    )
    add_knob_options(parser, (BY_NAME[name] for name in WIDEN_KNOBS))
    parser.add_argument(
        "--waves",
        default="fixed:1",
        metavar="STRATEGY",
        help="fixed:N (N nodes a wave), linear:N (N, 2N, 3N...), exponential:N (N, 2N, 4N...), or "
        "plan:FILE, the waves of `gpucanary plan-sweep --json`; default fixed:1",
    )
    parser.add_argument(
        "--soak-s",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="How long each wave must stay upgraded and undisturbed (default 300)",
    )
    parser.add_argument(
        "--wave-budget-s",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="Longest a wave may take to reach upgrade-done (default 1800)",
    )
    parser.add_argument(
        "--max-age-h",
        type=float,
        default=24.0,
        metavar="HOURS",
        help="Oldest passing verdict that counts, in hours (default 24)",
    )
    parser.add_argument(
        "--nvidiadriver",
        metavar="NAME",
        help="NVIDIADriver mode: the NVIDIADriver to widen (needed when there are several)",
    )
    parser.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="'QUERY < N'",
        help="A service SLO every wave must keep, read from --gpucanary-prometheus-url: every series "
        "of the PromQL answer on the right side of N (<, <=, >, >=); repeatable",
    )
    parser.add_argument("--resume", action="store_true", help="Go on with the sweep of this change a killed widen left")
    parser.add_argument(
        "--rollback",
        action="store_true",
        help="When a wave fails: restore the policy object (the failed wave returns to the old "
        "driver under the operator's own policy) and release every hold, as cleanup does",
    )
    parser.set_defaults(handler=_cmd_widen)


def _cmd_widen(args: argparse.Namespace) -> ExitCode:
    import signal

    from pytest_gpucanary.canary.metrics import Prometheus
    from pytest_gpucanary.policy.parse import load_policy
    from pytest_gpucanary.widen import plan, receipt
    from pytest_gpucanary.widen.rollout import Refused, WidenOptions, widen
    from pytest_gpucanary.widen.slo import Slo

    settings, policy_path, driver_to = _change_settings(args, "a sweep rolls out one policy and one target driver")
    for name, value, least in (
        ("--soak-s", args.soak_s, 0),
        ("--wave-budget-s", args.wave_budget_s, 1),
        ("--max-age-h", args.max_age_h, 0.01),
    ):
        if not (value >= least and math.isfinite(value)):
            raise ConfigError(f"{name}={value:g} is out of range", hint=f"{least:g} or more")
    strategy = plan.Strategy.parse(args.waves)
    slos = tuple(Slo.parse(text) for text in args.slo)
    policy = load_policy(policy_path, helm=_helm(settings))
    prometheus_url = target.prometheus_url(settings) if slos else settings.prometheus_url
    if slos and not prometheus_url:
        raise ConfigError("--slo is read from a Prometheus", hint=f"pass {flag('prometheus_url')} URL")
    kube = target.connect(settings)
    opts = WidenOptions(
        policy.to_cr(),
        driver_to,
        strategy,
        soak_s=args.soak_s,
        wave_budget_s=args.wave_budget_s,
        max_age_s=args.max_age_h * 3600,
        nvidiadriver=args.nvidiadriver,
        resume=args.resume,
        rollback=args.rollback,
        settings=settings,
        slos=slos,
        prometheus=Prometheus(prometheus_url) if slos and prometheus_url else None,
    )
    latest: list = []
    unwritable: list[str] = []

    def keep(sweep: object) -> None:
        latest[:] = [sweep]
        where = settings.reports_dir / sweep.run_id  # type: ignore[attr-defined]
        try:
            receipt.write(where, sweep)  # type: ignore[arg-type]
        except OSError as err:  # the sweep's record is in the cluster: a receipt it cannot write is one line
            if not unwritable:
                unwritable.append(str(where))
                _progress(f"widen: cannot write the receipt in {where}: {err.strerror or err}")

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        sweep = widen(kube, opts, report=_progress, on_sweep=keep)
    except Refused as why:
        _progress(f"gpucanary: hold: {why}")
        return ExitCode.GATE_FAILED
    except KeyboardInterrupt:
        if latest:
            _progress(
                f"widen: stopped; sweep {latest[0].run_id}'s holds stay: `gpucanary widen --resume` with the "
                f"same options goes on, `gpucanary cleanup --run-id {latest[0].run_id}` rolls it back"
            )
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    _progress(f"widen: receipt in {settings.reports_dir / sweep.run_id}")
    return ExitCode.OK if sweep.status == "done" else ExitCode.GATE_FAILED


def _add_cleanup(sub: argparse._SubParsersAction) -> None:
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
    result = cleanup(kube, run_id=args.run_id, force=args.force, wait_s=args.wait_s, report=_progress)
    _progress(f"cleanup: {result.restored} objects deleted or restored")
    if result.problems:
        _progress(f"cleanup: {len(result.problems)} problems; what they name is still held or left as it is")
        return ExitCode.ENVIRONMENT
    return ExitCode.OK


def _add_lint(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "lint",
        help="Validate an upgrade policy and predict its blast radius",
        description="Validate a ClusterPolicy, NVIDIADriver or gpu-operator Helm values file "
        "and print one finding per line: severity code path: message. "
        "Exit 1 if any finding is an error.",
    )
    parser.add_argument("policy", metavar="POLICY", help="Policy YAML: ClusterPolicy, NVIDIADriver or Helm values")
    parser.add_argument(
        "--against",
        metavar="OLD_POLICY",
        help="Also print the knobs changed since OLD_POLICY and the findings each change adds (+) or removes (-)",
    )
    parser.add_argument("--json", action="store_true", help="Print the findings (and changes) as JSON")
    for knob in (BY_NAME["helm_chart"], BY_NAME["helm_binary"]):
        parser.add_argument(
            knob.flag, dest=knob.name, default=None, metavar="PATH", help=f"{knob.help} (env {knob.env})"
        )
    parser.set_defaults(handler=_cmd_lint)


def _helm(settings: Settings) -> HelmChart:
    from pytest_gpucanary.policy.helm import HelmChart

    return HelmChart.from_settings(settings, fleet_chart=target.chart(settings))


def _cmd_lint(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.policy import diff as policy_diff
    from pytest_gpucanary.policy import lint as policy_lint
    from pytest_gpucanary.policy.parse import load_policy

    # Helm values render with the named chart, else the local fleet's release chart
    helm = _helm(Settings.resolve(lambda knob: getattr(args, knob.name, None), env_source(os.environ)))
    policy = load_policy(args.policy, helm=helm)
    changes = policy_diff.diff_policies(load_policy(args.against, helm=helm), policy) if args.against else None
    findings = policy_lint.lint_policy(policy)
    output = (policy_diff.render_json if args.json else policy_diff.render_lines)(findings, changes, policy=policy)
    if output:
        print(output)
    return ExitCode.GATE_FAILED if policy_lint.has_errors(findings) else ExitCode.OK


def _add_gate(sub: argparse._SubParsersAction) -> None:
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
        helm=_helm(settings),
    )
    env, bed = dict(os.environ), None
    if settings.kubeconfig is None:
        bed = target.test_bed()
        bed.up(progress=_progress)  # once here: two runs starting it at once would race
        env["GPUCANARY_FLEET_KEEP"] = "1"
    try:
        cluster = discover(target.connect(settings))
        per_run_pool = getattr(target.pool_provider(settings), "fresh_per_run", False)
        parallel = cluster.nvidiadriver_mode and cluster.per_driver_policy and per_run_pool and not args.sequential
        if not parallel and not args.sequential:
            _progress(
                f"gate: {cluster.mode} mode, per-driver upgradePolicy {cluster.per_driver_policy}, "
                f"pool made per run {per_run_pool}: base and head run one after the other"
            )
        outcome = gate.gate(planned, run_args=args.pytest_args, parallel=parallel, env=env, progress=_progress)
    finally:
        if bed is not None and not settings.fleet_keep:
            bed.down(progress=_progress)
    if outcome.comparison is None:
        failed = {label: code for label, code in outcome.exit_codes.items() if code not in (0, 1)}
        _progress(
            f"gpucanary: error: the {' and '.join(failed)} run could not happen (exit "
            f"{', '.join(map(str, failed.values()))}); see {outcome.gate_dir}/<side>.log"
        )
        if ExitCode.INTERRUPTED in failed.values():
            return ExitCode.INTERRUPTED
        return ExitCode.USAGE if set(failed.values()) == {ExitCode.USAGE} else ExitCode.ENVIRONMENT
    for regression in outcome.comparison.regressions:
        _progress(f"gate: {regression.rule}: {regression.line}")
    _progress(f"gate: {outcome.comparison.headline()}")
    print(outcome.receipt["markdown"])
    return ExitCode.OK if outcome.comparison.gate_passed else ExitCode.GATE_FAILED


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_run,
    _add_preflight,
    _add_evaluate,
    _add_verdict,
    _add_cleanup,
    _add_widen,
    _add_plan_sweep,
    _add_lint,
    _add_gate,
)


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
    for extra in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        extra.load()(sub)  # a test bed's own commands (the local fleet's `gpucanary fleet`)
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
