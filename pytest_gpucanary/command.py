"""What every `gpucanary` subcommand shares: the exit codes, progress lines on stderr, knobs as options,
the settings of a command about one change, and the chart a Helm values policy renders with.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucanary import target
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.knobs import Knob, env_source

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


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_knob_options(parser: argparse.ArgumentParser, knobs: Iterable[Knob]) -> None:
    """Each knob as its --gpucanary-* option, None when not given (so the environment and defaults resolve it)."""
    for knob in knobs:
        kwargs: dict[str, Any] = (
            {"action": "store_const", "const": "true"} if knob.type is bool else {"metavar": knob.name.upper()}
        )
        parser.add_argument(knob.flag, dest=knob.name, default=None, help=knob.help, **kwargs)


def change_settings(args: argparse.Namespace, what: str) -> tuple[Settings, Path, str]:
    """The settings of a command about one change, with its policy and target driver, both given."""
    settings = Settings.resolve(lambda knob: getattr(args, knob.name, None), env_source(os.environ))
    if settings.policy is None or not settings.driver_version:
        raise ConfigError(
            what, hint=f"pass {flag('policy')} PATH and {flag('driver_version')} VERSION, as the canary run had"
        )
    return settings, settings.policy, settings.driver_version


def helm(settings: Settings) -> HelmChart:
    from pytest_gpucanary.policy.helm import HelmChart

    return HelmChart.from_settings(settings, fleet_chart=target.chart(settings))
