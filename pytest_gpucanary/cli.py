"""The `gpucanary` command: one error boundary, subcommands from a table, exit codes in one enum (`command`).

Each product's subcommands live with it (`canary.command`, `widen.command`, `sweep.command`, `policy.command`,
`premerge.command`); a test bed adds its own through the `gpucanary.commands` entry points.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from pytest_gpucanary.canary.command import add_cleanup, add_evaluate, add_preflight, add_run, add_verdict
from pytest_gpucanary.command import ExitCode
from pytest_gpucanary.errors import ConfigError, GpucanaryError
from pytest_gpucanary.policy.command import add_lint
from pytest_gpucanary.premerge.command import add_gate
from pytest_gpucanary.sweep.command import add_plan_sweep
from pytest_gpucanary.widen.command import add_widen

COMMANDS_GROUP = "gpucanary.commands"  # entry points: (subparsers) -> None, adding subcommands
EXIT_CODES_HELP = ", ".join(f"{code.value} {code.name.lower().replace('_', ' ')}" for code in ExitCode)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_run,
    add_preflight,
    add_evaluate,
    add_verdict,
    add_cleanup,
    add_widen,
    add_plan_sweep,
    add_lint,
    add_gate,
)


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
