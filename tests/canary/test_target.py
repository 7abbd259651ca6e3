"""The target resolver: the pool preflight checks and the gate plans for is the one the run gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpucanary import target
from pytest_gpucanary.canary.pool.existing_node import ExistingNodeProvider
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError

PLUGIN = '''
class OwnPool:
    fresh_per_run = True

    def __init__(self, node):
        self.node = node


def pytest_gpucanary_make_pool(config, settings):
    return OwnPool(settings.pool_node)
'''


def test_a_plugin_hook_gives_preflight_and_the_gate_its_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "own_pool_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = Settings(kubeconfig=str(tmp_path / "kubeconfig"), pool_node="gpu-7")

    provider = target.hooked_pool_provider(settings, ["-p", "own_pool_plugin"])

    assert type(provider).__name__ == "OwnPool" and provider.node == "gpu-7"
    assert getattr(provider, "fresh_per_run", False)


def test_without_a_plugin_the_run_carves_out_existing_nodes(tmp_path: Path) -> None:
    settings = Settings(kubeconfig=str(tmp_path / "kubeconfig"), pool_node="gpu-7")

    provider = target.hooked_pool_provider(settings)

    assert isinstance(provider, ExistingNodeProvider) and provider.node == "gpu-7"
    assert not getattr(provider, "fresh_per_run", False)


def test_a_plugin_that_does_not_exist_is_one_usage_line(tmp_path: Path) -> None:
    settings = Settings(kubeconfig=str(tmp_path / "kubeconfig"))

    with pytest.raises(ConfigError) as raised:
        target.hooked_pool_provider(settings, ["-p", "no_such_pool_plugin"])

    assert "no_such_pool_plugin" in str(raised.value) and "\n" not in str(raised.value)
