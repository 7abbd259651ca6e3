"""The local GPU fleet: the test bed a run targets without a kubeconfig (see target.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_gpucanary.fleet.fleet import Fleet

__all__ = ["Fleet"]


def __getattr__(name: str) -> object:
    # lazily, so `gpucanary lint` (which loads the fleet's subcommand) never imports the kubernetes client
    if name == "Fleet":
        from pytest_gpucanary.fleet.fleet import Fleet

        return Fleet
    raise AttributeError(name)
