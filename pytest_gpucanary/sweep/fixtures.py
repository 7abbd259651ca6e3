"""pytest fixtures for the sweep planner; load with `-p pytest_gpucanary.sweep.fixtures` or `pytest_plugins`.

Fixtures only: the planner itself never imports pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.sweep.inventory import Inventory, inventory_from_dict, load_inventory
from pytest_gpucanary.sweep.model import Change, Fleet, SweepLimits, SweepPlan, parse_change

InventoryInput = str | Path | Inventory | Fleet | Mapping[str, Any]
ChangeInput = Change | str | Sequence[str] | None
LimitsInput = SweepLimits | Mapping[str, Any] | None


def _inventory(source: InventoryInput) -> Inventory:
    if isinstance(source, Inventory):
        return source
    if isinstance(source, Fleet):
        return Inventory(source, None, SweepLimits())
    if isinstance(source, Mapping):
        return inventory_from_dict(source)
    return load_inventory(source)


def _change(change: ChangeInput, inventory: Inventory) -> Change:
    if isinstance(change, Change):
        return change
    if change:
        upgrade_s = inventory.change.node_upgrade_s if inventory.change else 900.0
        return parse_change([change] if isinstance(change, str) else list(change), node_upgrade_s=upgrade_s)
    if inventory.change is None:
        raise ConfigError("no change to plan", hint="pass change='driver=580.95.05' or add 'change:' to the inventory")
    return inventory.change


def _limits(limits: LimitsInput, inventory: Inventory) -> SweepLimits:
    if limits is None:
        return inventory.limits
    return limits if isinstance(limits, SweepLimits) else SweepLimits(**limits)


@pytest.fixture
def gpucanary_plan_sweep() -> Callable[..., SweepPlan]:
    """Factory: `plan(inventory, change=..., limits=...) -> SweepPlan`.

    `inventory` is a YAML path, an Inventory, a Fleet or a dict in the YAML schema; `change` a Change,
    "driver=580.95.05" or a list of those (default: the inventory's); `limits` a SweepLimits or a dict
    of its fields (default: the inventory's). Bad input fails the test in one line; no plan raises
    NoSweepPlanError, so a test can expect it with `pytest.raises`.
    """
    from pytest_gpucanary.sweep.plan import plan_sweep

    def plan(inventory: InventoryInput, *, change: ChangeInput = None, limits: LimitsInput = None) -> SweepPlan:
        try:
            loaded = _inventory(inventory)
            return plan_sweep(loaded.fleet, _change(change, loaded), _limits(limits, loaded))
        except ConfigError as err:
            pytest.fail(f"gpucanary_plan_sweep: {err}", pytrace=False)

    return plan
