"""Settings: command line > ini > environment > default, knob by knob, and bad values refused as one
usage line (exit 4) before anything runs. The plugin is loaded from its entry point in a pytest
subprocess, as a user's run would load it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpucanary.config import KNOBS, Settings
from pytest_gpucanary.knobs import Knob, env_source
from pytest_gpucanary.errors import ConfigError

PRINT_SETTINGS = """
def test_t(gpucanary_settings):
    s = gpucanary_settings
    print(f"driver={s.driver_version} interval={s.probe_interval_s} size={s.pool_size} users={s.load_users} "
          f"keep={s.fleet_keep}")
"""


@pytest.fixture(autouse=True)
def no_gpucanary_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for knob in KNOBS:
        monkeypatch.delenv(knob.env, raising=False)


def test_cli_beats_ini_beats_env_beats_default(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCANARY_DRIVER_VERSION", "570.1")
    monkeypatch.setenv("GPUCANARY_PROBE_INTERVAL_S", "7")
    monkeypatch.setenv("GPUCANARY_POOL_SIZE", "3")
    monkeypatch.setenv("GPUCANARY_FLEET_KEEP", "yes")
    pytester.makeini("[pytest]\ngpucanary_driver_version = 575.2\ngpucanary_probe_interval_s = 2.5\n")
    pytester.makepyfile(PRINT_SETTINGS)

    result = pytester.runpytest_subprocess("-s", "-p", "no:locust", "--gpucanary-driver-version=580.3")

    result.stdout.fnmatch_lines(["*driver=580.3 interval=2.5 size=3 users=10 keep=True*"])
    assert result.ret == pytest.ExitCode.OK


@pytest.mark.parametrize(("args", "env", "shown"), [
    (["--gpucanary-allowed-evictions=app in a"], {}, "--gpucanary-allowed-evictions='app in a' *label selector*"),
    (["--gpucanary-probe-interval-s=nan"], {}, "--gpucanary-probe-interval-s=nan must be a finite number*"),
    ([], {"GPUCANARY_POOL_SIZE": "zero"}, "--gpucanary-pool-size='zero' is not a whole number*GPUCANARY_POOL_SIZE*"),
], ids=["selector", "nan", "env-int"])
def test_a_bad_value_stops_a_gate_run_with_one_usage_line(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                          args: list[str], env: dict[str, str], shown: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_gate(gpucanary_run):\n    pass\n")

    result = pytester.runpytest_inprocess("-p", "no:locust", *args)

    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert_one_usage_line(result, shown)


def test_a_bad_value_is_a_usage_error_for_a_test_that_reads_the_settings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(PRINT_SETTINGS)

    result = pytester.runpytest_inprocess("-p", "no:locust", "--gpucanary-pool-size=0")

    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert_one_usage_line(result, "--gpucanary-pool-size=0 must be at least 1*")


def assert_one_usage_line(result: pytest.RunResult, shown: str) -> None:
    output = result.stdout.lines + result.stderr.lines
    assert len([line for line in output if "gpucanary:" in line]) == 1, output
    result.stderr.fnmatch_lines([f"ERROR: gpucanary: {shown}"])
    assert "Traceback" not in "\n".join(output)


def source(values: dict[str, object]):
    return lambda knob: values.get(knob.name)


def test_resolve_takes_the_first_source_that_answers_knob_by_knob() -> None:
    cli = source({"driver_version": "580.3"})
    ini = source({"driver_version": "575.2", "probe_interval_s": "2.5", "allowed_evictions": None})
    env = env_source({"GPUCANARY_DRIVER_VERSION": "570.1", "GPUCANARY_PROBE_INTERVAL_S": "7",
                      "GPUCANARY_POOL_SIZE": "3", "GPUCANARY_ALLOWED_EVICTIONS": "app=web",
                      "GPUCANARY_RUN_ID": ""})       # an empty variable is unset

    settings = Settings.resolve(cli, ini, env)

    assert (settings.driver_version, settings.probe_interval_s, settings.pool_size) == ("580.3", 2.5, 3)
    assert settings.allowed_evictions == "app=web"                   # ini said nothing (None): env answers
    assert settings.run_id is None and settings.load_users == 10 and settings.reports_dir == Path("reports")
    assert Settings.resolve(env, ini, cli).driver_version == "570.1"  # the order of the sources is the precedence


def test_resolve_refuses_a_value_from_any_source_naming_its_other_spellings() -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.resolve(source({}), source({"max_error_ratio": "1.5"}))
    assert str(refused.value) == ("--gpucanary-max-error-ratio=1.5 must be a fraction 0..1; "
                                  "also settable as ini gpucanary_max_error_ratio or env GPUCANARY_MAX_ERROR_RATIO")
    with pytest.raises(ConfigError):
        Settings.resolve(source({"probe_interval_s": "inf"}))


def test_every_knob_has_one_spelling_per_source() -> None:
    knob = next(k for k in KNOBS if k.name == "driver_version")
    assert (knob.flag, knob.ini, knob.env) == ("--gpucanary-driver-version", "gpucanary_driver_version",
                                               "GPUCANARY_DRIVER_VERSION")
    assert all(isinstance(k, Knob) and k.help[0].isupper() and not k.help.endswith(".") for k in KNOBS)


@pytest.mark.parametrize(("env", "line"), [
    ({"GPUCANARY_FLEET_DRIVER_MODE": "daemonset"},
     "GPUCANARY_FLEET_DRIVER_MODE='daemonset' is unknown; use nvidiadriver or clusterpolicy"),
    ({"GPUCANARY_FLEET_KUBELET_NODES": "9"}, "GPUCANARY_FLEET_KUBELET_NODES=9 is out of range; use 0 (none) to 8"),
    ({"GPUCANARY_FLEET_PORT_BASE": "80"}, "GPUCANARY_FLEET_PORT_BASE=80 is out of range; use 1024 to 61000"),
    ({"GPUCANARY_FLEET_GPU_RDMA": "maybe"}, "GPUCANARY_FLEET_GPU_RDMA='maybe' is not a valid bool"),
    ({"GPUCANARY_FLEET_GPU_NODES": "four"}, "GPUCANARY_FLEET_GPU_NODES='four' is not a whole number"),
])
def test_the_fleets_settings_are_checked_as_the_runs_and_named_by_their_variable(env: dict, line: str) -> None:
    from pytest_gpucanary.fleet.layout import FleetSettings

    with pytest.raises(ConfigError) as refused:
        FleetSettings.from_env(env)
    assert str(refused.value) == line


def test_the_fleets_settings_resolve_from_the_environment_with_their_defaults(tmp_path) -> None:
    from pytest_gpucanary.fleet.layout import DEFAULT_PORT_BASE, FleetSettings

    assert FleetSettings.from_env({}) == FleetSettings()
    given = FleetSettings.from_env({"GPUCANARY_FLEET_DIR": str(tmp_path), "GPUCANARY_FLEET_KUBELET_POOL": "0",
                                    "GPUCANARY_FLEET_GPU_RDMA": "1", "GPUCANARY_FLEET_PORT_BASE": ""})
    assert (given.fleet_dir, given.fleet_kubelet_pool, given.fleet_gpu_rdma) == (tmp_path, False, True)
    assert given.fleet_port_base == DEFAULT_PORT_BASE and given.fleet_default_nvidiadriver is None
