"""`gpucanary lint`: the subcommand that lints a policy, and with `--against` says what a change to it adds."""

from __future__ import annotations

import argparse
import os

from pytest_gpucanary import command
from pytest_gpucanary.command import ExitCode
from pytest_gpucanary.config import BY_NAME, Settings
from pytest_gpucanary.knobs import env_source


def add_lint(sub: argparse._SubParsersAction) -> None:
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


def _cmd_lint(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.policy import diff as policy_diff
    from pytest_gpucanary.policy import lint as policy_lint
    from pytest_gpucanary.policy.parse import load_policy

    # Helm values render with the named chart, else the local fleet's release chart
    helm = command.helm(Settings.resolve(lambda knob: getattr(args, knob.name, None), env_source(os.environ)))
    policy = load_policy(args.policy, helm=helm)
    changes = policy_diff.diff_policies(load_policy(args.against, helm=helm), policy) if args.against else None
    findings = policy_lint.lint_policy(policy)
    output = (policy_diff.render_json if args.json else policy_diff.render_lines)(findings, changes, policy=policy)
    if output:
        print(output)
    return ExitCode.GATE_FAILED if policy_lint.has_errors(findings) else ExitCode.OK
