"""pytest wiring only: options, markers, fixtures, JUnit properties, terminal summary.

Imports the standard library, pytest and config; everything that talks to a cluster is imported
lazily inside fixtures, so `pytest --help` never loads `kubernetes`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import pytest

from pytest_gpucanary.config import KNOBS, Knob, Settings, env_source

pytest_plugins = ["pytest_gpucanary.sweep_fixtures"]

SETTINGS_KEY = pytest.StashKey["Settings"]()
OUTCOME_KEY = pytest.StashKey[Any]()
ERROR_KEY = pytest.StashKey[str]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpucanary import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpucanary", "GPU driver upgrade canary")
    for knob in KNOBS:
        kwargs: dict[str, Any] = {"action": "store_true"} if knob.type is bool else {"metavar": knob.name.upper()}
        group.addoption(knob.flag, dest=f"gpucanary_{knob.name}", default=None, help=f"{knob.help} (env {knob.env})",
                        **kwargs)
        parser.addini(f"gpucanary_{knob.name}", knob.help, default=None)
    group.addoption("--gpucanary-fleet-keep", action="store_true", default=None,
                    help="Leave the local fleet running after the session (env GPUCANARY_FLEET_KEEP)")
    parser.addini("gpucanary_fleet_keep", "Leave the local fleet running after the session", default=None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpucanary(stage): ladder stage this test gives evidence for")
    config.addinivalue_line("markers", "e2e: runs against the local GPU fleet")


def _cli(config: pytest.Config):
    return lambda knob: config.getoption(f"gpucanary_{knob.name}")


def _ini(config: pytest.Config):
    def source(knob: Knob) -> Any:
        value = config.getini(f"gpucanary_{knob.name}")
        return value if value not in ("", None, []) else None
    return source


def settings_from(config: pytest.Config) -> Settings:
    if SETTINGS_KEY not in config.stash:
        from pytest_gpucanary.errors import ConfigError

        try:
            config.stash[SETTINGS_KEY] = Settings.resolve(_cli(config), _ini(config), env_source(os.environ))
        except ConfigError as err:
            raise pytest.UsageError(f"gpucanary: {err}") from None
    return config.stash[SETTINGS_KEY]


def _keep_fleet(config: pytest.Config) -> bool:
    knob = Knob("fleet_keep", bool, False, "")
    from pytest_gpucanary.config import convert

    raw = next((v for v in (_cli(config)(knob), _ini(config)(knob), env_source(os.environ)(knob)) if v is not None),
               False)
    return bool(convert(knob, raw))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse bad gate input before any test runs or the cluster is touched: exit 4, one line."""
    if not any("gpucanary_run" in getattr(item, "fixturenames", ()) for item in items):
        return
    from pytest_gpucanary.errors import ConfigError
    from pytest_gpucanary.policy import load_policy

    settings = settings_from(config)
    try:
        settings.require_gate_inputs()
        load_policy(settings.policy)
    except ConfigError as err:
        raise pytest.UsageError(f"gpucanary: {err}") from None


@pytest.fixture(scope="session")
def gpucanary_settings(request: pytest.FixtureRequest) -> Settings:
    """The resolved --gpucanary-* settings (command line > ini > environment > default)."""
    return settings_from(request.config)


def _progress_writer(config: pytest.Config):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if reporter is None:
            print(line, file=sys.stderr)
        elif config.get_verbosity() >= 0:
            # fixtures run under output capture; progress of minutes-long waits must reach the CI log now
            with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                reporter.write_line(line)
                reporter.flush()
    return write


@pytest.fixture(scope="session")
def gpucanary_fleet(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A ready local GPU fleet, started once per run (left running if it was up before)."""
    from pytest_gpucanary.errors import GpucanaryError
    from pytest_gpucanary.fleet import Fleet
    from pytest_gpucanary.fleet.cluster_manager import FleetClusterManager

    manager = FleetClusterManager(Fleet.from_env(), progress=_progress_writer(request.config))
    try:
        manager.create()
    except GpucanaryError as err:
        pytest.fail(f"local fleet could not start: {err}", pytrace=False)
    yield manager
    if not _keep_fleet(request.config):
        manager.delete()


@pytest.fixture(scope="session")
def gpucanary_kube(request: pytest.FixtureRequest, gpucanary_settings: Settings) -> Any:
    """A client of the target cluster: --gpucanary-kubeconfig, else the local fleet."""
    from pytest_gpucanary.errors import GpucanaryError
    from pytest_gpucanary.kube import Kube

    kubeconfig = gpucanary_settings.kubeconfig
    if kubeconfig is None:
        kubeconfig = request.getfixturevalue("gpucanary_fleet").fleet.kubeconfig
    try:
        return Kube.connect(kubeconfig, context=gpucanary_settings.context)
    except GpucanaryError as err:
        request.config.stash[ERROR_KEY] = str(err)
        pytest.fail(str(err), pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_gpucanary_make_pool(config: pytest.Config, settings: Settings) -> Any:
    from pytest_gpucanary.pool import provider_for

    return provider_for(settings, local_fleet=settings.kubeconfig is None)


@pytest.fixture(scope="session")
def gpucanary_run(request: pytest.FixtureRequest, gpucanary_settings: Settings, gpucanary_kube: Any) -> Any:
    """The canary run, executed once per session: pool, policy, workloads, upgrade, ladder, receipt."""
    from pytest_gpucanary.errors import ConfigError, GpucanaryError
    from pytest_gpucanary.progress import ProgressLine
    from pytest_gpucanary.run import CanaryRun

    config = request.config
    if OUTCOME_KEY in config.stash:
        return config.stash[OUTCOME_KEY]
    if ERROR_KEY in config.stash:
        pytest.fail(config.stash[ERROR_KEY], pytrace=False)
    provider = config.hook.pytest_gpucanary_make_pool(config=config, settings=gpucanary_settings)
    fleet = None if gpucanary_settings.kubeconfig else request.getfixturevalue("gpucanary_fleet").fleet
    try:
        outcome = CanaryRun(gpucanary_settings, gpucanary_kube, provider, fleet=fleet,
                            progress=ProgressLine(_progress_writer(config))).execute()
    except ConfigError as err:  # found on the cluster (an unknown pool node): still the caller's input
        config.stash[ERROR_KEY] = f"gpucanary: {err}"
        pytest.exit(config.stash[ERROR_KEY], returncode=pytest.ExitCode.USAGE_ERROR)
    except GpucanaryError as err:
        config.stash[ERROR_KEY] = f"gpucanary: {err}"
        pytest.fail(config.stash[ERROR_KEY], pytrace=False)
    config.stash[OUTCOME_KEY] = outcome
    return outcome


@pytest.fixture(autouse=True)
def _gpucanary_junit_properties(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("gpucanary")
    if marker is None or "gpucanary_run" not in request.fixturenames:
        return
    outcome = request.getfixturevalue("gpucanary_run")
    for key, value in (("gpucanary_run_id", outcome.run_id), ("gpucanary_pool", ",".join(outcome.pool.nodes)),
                       ("gpucanary_driver_from", outcome.pool.driver_from), ("gpucanary_driver_to", outcome.driver_to),
                       ("gpucanary_stage", marker.args[0] if marker.args else "")):
        request.node.user_properties.append((key, value))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    outcome = config.stash.get(OUTCOME_KEY, None)
    if outcome is None or outcome.result is None:
        return
    result = outcome.result
    terminalreporter.section("gpucanary launch receipt")
    for verdict in result.verdicts:
        terminalreporter.write_line(f"{verdict.outcome.value:>12}  {verdict.summary}")
    failed = result.first_failed.value if result.first_failed else "none"
    terminalreporter.write_line(f"gate {'PASSED' if result.gate_passed else 'FAILED'}; first failed stage: {failed}; "
                                f"receipt: {outcome.receipt.get('html', outcome.report_dir)}")


