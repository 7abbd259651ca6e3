"""What a sweep is asked to do: the change, the waves, their soak and budget, the SLOs and where they are read."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpucanary.canary.metrics import Prometheus
from pytest_gpucanary.config import Settings
from pytest_gpucanary.widen import plan
from pytest_gpucanary.widen.slo import Slo


@dataclass(frozen=True)
class WidenOptions:
    upgrade_policy: dict
    target: str
    strategy: plan.Strategy
    soak_s: float = 300.0
    wave_budget_s: float = 1800.0
    max_age_s: float = 24 * 3600.0
    nvidiadriver: str | None = None
    resume: bool = False
    rollback: bool = False
    settings: Settings = Settings()
    slos: tuple[Slo, ...] = ()
    prometheus: Prometheus | None = None  # where the SLOs are read
