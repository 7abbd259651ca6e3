"""`gpucanary fleet up|status|down`: the local fleet's own subcommand (entry point `gpucanary.commands`)."""

from __future__ import annotations

import argparse
import sys

from pytest_gpucanary.command import ExitCode


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("fleet", help="Run the local GPU fleet (real control plane, KWOK GPU nodes)")
    actions = parser.add_subparsers(dest="fleet_action", required=True)
    up = actions.add_parser("up", help="Build (if needed) and start the fleet; idempotent")
    up.add_argument(
        "--gpu-nodes",
        type=int,
        default=None,
        help="Number of simulated GPU nodes (env GPUCANARY_FLEET_GPU_NODES, default 4)",
    )
    actions.add_parser("status", help="Print the kubeconfig path and the state of each component")
    actions.add_parser("down", help="Stop every fleet process and free its ports")
    parser.set_defaults(handler=_cmd_fleet)


def _cmd_fleet(args: argparse.Namespace) -> ExitCode:
    from pytest_gpucanary.fleet.fleet import Fleet

    fleet = Fleet.from_env()
    if args.fleet_action == "up":
        if args.gpu_nodes is not None:
            fleet = fleet.with_gpu_nodes(args.gpu_nodes)
        fleet.up(progress=progress)
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
        fleet.down(progress=progress)
    return ExitCode.OK
