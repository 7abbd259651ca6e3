"""pytest wiring only: options, markers, one session object, fixtures, JUnit properties, terminal summary.

Imports the standard library, pytest and config; everything that talks to a cluster is imported
lazily, so `pytest --help` never loads `kubernetes`. `GpucanarySession` (registered as
"gpucanary-session") owns the settings, the run's outcome, the typed error and the exit status.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_gpucanary import target
from pytest_gpucanary.config import KNOBS, Settings
from pytest_gpucanary.errors import ConfigError, EnvError, GpucanaryError
from pytest_gpucanary.knobs import Knob, env_source

if TYPE_CHECKING:
    from pytest_gpucanary.canary.outcome import RunOutcome
    from pytest_gpucanary.canary.pool import PoolProvider
    from pytest_gpucanary.kube import Kube
    from pytest_gpucanary.policy.model import UpgradePolicy
    from pytest_gpucanary.target import TestBed

pytest_plugins = ["pytest_gpucanary.sweep.fixtures"]

SESSION_KEY = pytest.StashKey["GpucanarySession"]()
ENVIRONMENT_EXIT_STATUS = 6  # command.ExitCode.ENVIRONMENT: the cluster or the fleet could not run the gate


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpucanary import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpucanary", "GPU driver upgrade canary")
    for knob in KNOBS:
        kwargs: dict[str, Any] = {"action": "store_true"} if knob.type is bool else {"metavar": knob.name.upper()}
        group.addoption(knob.flag, dest=knob.ini, default=None, help=f"{knob.help} (env {knob.env})", **kwargs)
        parser.addini(knob.ini, knob.help, default=None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpucanary(stage): ladder stage this test gives evidence for")
    config.addinivalue_line("markers", "e2e: runs against the local GPU fleet")
    config.stash[SESSION_KEY] = session = GpucanarySession(config)
    config.pluginmanager.register(session, "gpucanary-session")


def _cli(config: pytest.Config) -> Callable[[Knob], Any]:
    return lambda knob: config.getoption(knob.ini)


def _ini(config: pytest.Config) -> Callable[[Knob], Any]:
    def source(knob: Knob) -> Any:
        value = config.getini(knob.ini)
        return value if value not in ("", None, []) else None

    return source


class GpucanarySession:
    """Settings, the canary run's outcome or its typed error, and the exit status, for one pytest session."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._settings: Settings | None = None
        self.outcome: RunOutcome | None = None
        self.error: GpucanaryError | None = None
        self.inputs: UpgradePolicy | None = None  # the policy, read and checked at collection
        self.run_properties_recorded = False

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            try:
                self._settings = Settings.resolve(_cli(self.config), _ini(self.config), env_source(os.environ))
            except ConfigError as err:
                raise pytest.UsageError(f"gpucanary: {err}") from None
        return self._settings

    @property
    def error_line(self) -> str:
        return f"gpucanary: {self.error}" if self.error else ""

    def fail(self, error: GpucanaryError) -> NoReturn:
        """Stop the session with the error's one line, printed once: exit 4 for the caller's input found on
        the cluster (an unknown pool node), 6 for a run that could not happen (not a gate that said no)."""
        self.error = self.error or error
        code = pytest.ExitCode.USAGE_ERROR if isinstance(self.error, ConfigError) else ENVIRONMENT_EXIT_STATUS
        pytest.exit(self.error_line, returncode=code)

    def run(self, request: pytest.FixtureRequest, kube: Kube) -> RunOutcome:
        """The canary run, executed once per session."""
        if self.outcome is not None:
            return self.outcome
        if self.error is not None:
            self.fail(self.error)
        from pytest_gpucanary.canary.run import CanaryRun
        from pytest_gpucanary.progress import ProgressLine

        settings = self.settings
        provider = self.config.hook.pytest_gpucanary_make_pool(config=self.config, settings=settings)
        bed = None if settings.kubeconfig else request.getfixturevalue("gpucanary_test_bed")
        try:
            self.outcome = CanaryRun(
                settings, kube, provider, fleet=bed, progress=ProgressLine(self.progress_writer()), policy=self.inputs
            ).execute()
        except GpucanaryError as err:
            self.fail(err)
        return self.outcome

    def progress_writer(self) -> Callable[[str], None]:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")

        def write(line: str) -> None:
            if reporter is None:
                print(line, file=sys.stderr)
            elif self.config.get_verbosity() >= 0:
                # fixtures run under output capture; progress of minutes-long waits must reach the CI log now
                with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                    reporter.write_line(line)
                    reporter.flush()

        return write

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """A bad --gpucanary-* value (or its ini key or environment variable) stops the session: exit 4, one line."""
        _ = self.settings

    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        """Refuse bad gate input before any test runs or the cluster is touched: exit 4, one line."""
        if not any("gpucanary_run" in getattr(item, "fixturenames", ()) for item in items):
            return
        from pytest_gpucanary.canary.run import check_inputs

        try:
            self.inputs = check_inputs(self.settings, fleet_chart=target.chart(self.settings))  # once per run
        except ConfigError as err:
            raise pytest.UsageError(f"gpucanary: {err}") from None

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.outcome is None:
            return
        result = self.outcome.result
        terminalreporter.section("gpucanary launch receipt")
        for verdict in result.verdicts:
            terminalreporter.write_line(f"{verdict.outcome.value:>12}  {verdict.summary}")
        failed = result.first_failed.value if result.first_failed else "none"
        where = self.outcome.receipt.get("html", str(self.outcome.report_dir))
        terminalreporter.write_line(
            f"gate {'PASSED' if result.gate_passed else 'FAILED'}; first failed stage: {failed}; receipt: {where}"
        )


def _session(request: pytest.FixtureRequest) -> GpucanarySession:
    return request.config.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def gpucanary_settings(request: pytest.FixtureRequest) -> Settings:
    """The resolved --gpucanary-* settings (command line > ini > environment > default)."""
    return _session(request).settings


@pytest.fixture(scope="session")
def gpucanary_test_bed(request: pytest.FixtureRequest) -> Iterator[TestBed]:
    """The local test bed (the run's target without --gpucanary-kubeconfig), started once per session and
    stopped after it unless it was up before or --gpucanary-fleet-keep."""
    session = _session(request)
    try:
        bed = target.test_bed()
        was_up = bed.is_up()
        bed.up(progress=session.progress_writer())
    except GpucanaryError as err:
        session.fail(EnvError(f"local test bed could not start: {err}"))
    yield bed
    if not was_up and not session.settings.fleet_keep:
        bed.down(progress=session.progress_writer())


@pytest.fixture(scope="session")
def gpucanary_kube(request: pytest.FixtureRequest, gpucanary_settings: Settings) -> Kube:
    """A client of the target cluster: --gpucanary-kubeconfig, else the local fleet."""
    from pytest_gpucanary.kube import Kube

    kubeconfig = gpucanary_settings.kubeconfig
    if kubeconfig is None:
        kubeconfig = request.getfixturevalue("gpucanary_test_bed").kubeconfig
    try:
        return Kube.connect(kubeconfig, context=gpucanary_settings.context)
    except GpucanaryError as err:
        _session(request).fail(err)


@pytest.hookimpl(trylast=True)
def pytest_gpucanary_make_pool(config: pytest.Config, settings: Settings) -> PoolProvider:
    """The default: the test bed's own pool where it is the target, else existing nodes carved out."""
    return target.pool_provider(settings)


@pytest.fixture(scope="session")
def gpucanary_run(request: pytest.FixtureRequest, gpucanary_kube: Kube) -> RunOutcome:
    """The canary run, executed once per session: pool, policy, workloads, upgrade, ladder, receipt."""
    return _session(request).run(request, gpucanary_kube)


@pytest.fixture(autouse=True)
def _gpucanary_junit_properties(request: pytest.FixtureRequest) -> None:
    """JUnit <testsuite> properties: the run's facts once, then the stage of each marked test.

    Strict JUnit schemas (Jenkins xUnit's junit-10.xsd) allow <properties> only in a <testsuite>, so
    nothing goes into the test's own user_properties.
    """
    marker = request.node.get_closest_marker("gpucanary")
    if marker is None or "gpucanary_run" not in request.fixturenames:
        return
    evidence = request.getfixturevalue("gpucanary_run").evidence
    if not request.config.pluginmanager.has_plugin("junitxml"):
        return
    record = request.getfixturevalue("record_testsuite_property")
    session = _session(request)
    if not session.run_properties_recorded:
        session.run_properties_recorded = True
        for key, value in (
            ("gpucanary_run_id", evidence.run_id),
            ("gpucanary_pool", ",".join(evidence.pool_nodes)),
            ("gpucanary_driver_from", evidence.driver_from),
            ("gpucanary_driver_to", evidence.driver_to),
        ):
            record(key, value)
    record(f"gpucanary_stage:{request.node.nodeid}", marker.args[0] if marker.args else "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A stage test failed with pytest.fail(summary, pytrace=False): report the summary alone, so the
    JUnit failure message starts with `<stage>: <measured> <op> <threshold>`, not `Failed: `."""
    report = yield
    excinfo = call.excinfo
    if (
        report.failed
        and excinfo is not None
        and isinstance(excinfo.value, pytest.fail.Exception)
        and not excinfo.value.pytrace
        and item.get_closest_marker("gpucanary") is not None
    ):
        report.longrepr = excinfo.value.msg
    return report
