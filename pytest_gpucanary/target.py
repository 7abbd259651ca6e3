"""What a run, a preflight and a gate point at, resolved one way for all three: the cluster, the pool
provider, Prometheus and the chart a Helm values policy renders with.

With `--gpucanary-kubeconfig` the target is that cluster. Without it, the target is a local test bed: the
one installed under the `gpucanary.test_bed` entry point group (this package's local GPU fleet is one), so
nothing outside the test bed knows which it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import ConfigError

if TYPE_CHECKING:
    from pytest_gpucanary.canary.pool import PoolProvider
    from pytest_gpucanary.kube import Kube

TEST_BED_GROUP = "gpucanary.test_bed"
LOCAL_POOLS = ("kubelet", "kwok")  # --gpucanary-pool-provider values that only a test bed provides


class TestBed(Protocol):
    """A local cluster the canary starts and points at when it is given none."""

    @property
    def kubeconfig(self) -> Path: ...

    @property
    def prometheus_url(self) -> str: ...

    def is_up(self) -> bool: ...

    def up(self, *, progress: Callable[[str], None]) -> None: ...

    def down(self, *, progress: Callable[[str], None]) -> None: ...

    def service_url(self, namespace: str, name: str) -> str: ...

    def helm_chart(self) -> Path: ...

    def pool_provider(self, settings: Settings) -> PoolProvider | None:
        """Its own pool for the settings, or None where the existing-node provider carves one out."""


def test_bed() -> TestBed:
    found = sorted(entry_points(group=TEST_BED_GROUP), key=lambda ep: ep.name)
    if not found:
        raise ConfigError(
            f"no {flag('kubeconfig')} and no local test bed installed",
            hint=f"pass {flag('kubeconfig')} PATH of the cluster to canary",
        )
    return found[0].load()()


def uses_test_bed(settings: Settings) -> bool:
    return settings.kubeconfig is None or settings.pool_provider in LOCAL_POOLS


def connect(settings: Settings) -> Kube:
    """A client of the cluster the settings name, else of the test bed (which must be up)."""
    from pytest_gpucanary.kube import Kube

    if settings.kubeconfig:
        return Kube.connect(settings.kubeconfig, context=settings.context)
    return Kube.connect(test_bed().kubeconfig)


def pool_provider(settings: Settings) -> PoolProvider:
    """The pool a run gets unless a `pytest_gpucanary_make_pool` hook gives another (also what preflight and
    the gate check): the test bed's own where it is the target or a pool of its kind is asked for, else
    existing nodes carved out."""
    if uses_test_bed(settings) and settings.pool_provider != "existing":
        provider = test_bed().pool_provider(settings)
        if provider is not None:
            return provider
    from pytest_gpucanary.canary.pool.existing_node import ExistingNodeProvider

    return ExistingNodeProvider.from_settings(settings)


def hooked_pool_provider(settings: Settings, pytest_args: Sequence[str] = ()) -> PoolProvider:
    """The pool `gpucanary run` with these pytest arguments gets: its plugins (installed ones, `-p NAME`) and
    the shipped gate's conftest asked through the `pytest_gpucanary_make_pool` hook, as the run asks them, so a
    preflight checks and a gate plans for the pool the run will use."""
    import pytest

    from pytest_gpucanary.shipped import gate_pytest_args

    with gate_pytest_args(list(pytest_args)) as args:
        try:
            config = pytest.Config.fromdictargs({}, args)
        except pytest.UsageError as err:
            raise ConfigError(str(err).splitlines()[0]) from None
    try:
        return config.hook.pytest_gpucanary_make_pool(config=config, settings=settings)
    finally:
        config._ensure_unconfigure()


def prometheus_url(settings: Settings) -> str | None:
    if settings.prometheus_url or settings.kubeconfig:
        return settings.prometheus_url
    return test_bed().prometheus_url


def chart(settings: Settings) -> Callable[[], Path] | None:
    """With the test bed as the target, where its release's gpu-operator chart is (looked up only when a Helm
    values policy needs it); None for a real cluster, which names its chart."""
    if settings.kubeconfig is not None:
        return None
    return lambda: test_bed().helm_chart()
