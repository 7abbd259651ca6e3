"""`gpucanary widen`: the subcommand that rolls a change the canary passed out to the rest of the fleet."""

from __future__ import annotations

import argparse
import math

from pytest_gpucanary import target
from pytest_gpucanary.canary.command import VERDICT_KNOBS
from pytest_gpucanary.command import ExitCode, add_knob_options, change_settings, helm, progress
from pytest_gpucanary.config import BY_NAME, flag
from pytest_gpucanary.errors import ConfigError

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


def add_widen(sub: argparse._SubParsersAction) -> None:
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
    from pytest_gpucanary.widen.options import WidenOptions
    from pytest_gpucanary.widen.rollout import Refused, widen
    from pytest_gpucanary.widen.slo import Slo

    settings, policy_path, driver_to = change_settings(args, "a sweep rolls out one policy and one target driver")
    for name, value, least in (
        ("--soak-s", args.soak_s, 0),
        ("--wave-budget-s", args.wave_budget_s, 1),
        ("--max-age-h", args.max_age_h, 0.01),
    ):
        if not (value >= least and math.isfinite(value)):
            raise ConfigError(f"{name}={value:g} is out of range", hint=f"{least:g} or more")
    strategy = plan.Strategy.parse(args.waves)
    slos = tuple(Slo.parse(text) for text in args.slo)
    policy = load_policy(policy_path, helm=helm(settings))
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
                progress(f"widen: cannot write the receipt in {where}: {err.strerror or err}")

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        sweep = widen(kube, opts, report=progress, on_sweep=keep)
    except Refused as why:
        progress(f"gpucanary: hold: {why}")
        return ExitCode.GATE_FAILED
    except KeyboardInterrupt:
        if latest:
            progress(
                f"widen: stopped; sweep {latest[0].run_id}'s holds stay: `gpucanary widen --resume` with the "
                f"same options goes on, `gpucanary cleanup --run-id {latest[0].run_id}` rolls it back"
            )
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    progress(f"widen: receipt in {settings.reports_dir / sweep.run_id}")
    return ExitCode.OK if sweep.status == "done" else ExitCode.GATE_FAILED
