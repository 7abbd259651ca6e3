"""The checkpoint-aware sweep model: fleet, change, limits, restore rules and the records a plan is made of.

Pure data and rules; the planner is `sweep.plan`, the strategy comparison `sweep.compare`, inputs
`sweep.inventory`, rendering `sweep.report`. Nothing here touches a cluster or imports `kubernetes`.

Restore rules (the field note's table). A checkpoint records the versions it was taken against; any
field left out was not recorded. It restores on a node only when the GPU model is the same and every
recorded version equals the node's:

- a driver, CUDA or engine change makes the node's version differ once the node is upgraded, so the
  checkpoint still restores on nodes on the old set, and the workload reaches the new stack later by
  one cold start;
- a model change invalidates the checkpoint everywhere: the workload must serve the new model, so it
  starts on the new version with a cold start (checkpointing resumes from there);
- a change to nothing the checkpoint records leaves it valid: it restores anywhere with the same GPU
  model, upgraded nodes included.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from pytest_gpucanary.errors import ConfigError, GpucanaryError


class Component(enum.StrEnum):
    DRIVER = "driver"
    CUDA = "cuda"
    ENGINE = "engine"
    MODEL = "model"


COMPONENTS = ", ".join(c.value for c in Component)


@dataclass(frozen=True, slots=True)
class VersionSet:
    """Versions of a node, or those a checkpoint recorded; None means not present / not recorded."""

    driver: str | None = None
    cuda: str | None = None
    engine: str | None = None
    model: str | None = None

    def get(self, component: Component) -> str | None:
        return getattr(self, component.value)

    def recorded(self) -> tuple[tuple[Component, str], ...]:
        return tuple((c, v) for c in Component if (v := self.get(c)) is not None)

    def label(self) -> str:
        return " ".join(f"{c.value}={v}" for c, v in self.recorded()) or "(none)"


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpu_model: str
    gpus: int
    versions: VersionSet


@dataclass(frozen=True, slots=True)
class Workload:
    """A single-node GPU workload as it runs now.

    `checkpoint` is the version set its checkpoint was taken against (None: it holds none);
    `since_start_s` is the in-memory work built since it last started, which a stop without a usable
    checkpoint destroys; `remaining_s` is how long it still runs (None: until stopped, e.g. serving).
    """

    name: str
    node: str
    gpus: int
    checkpoint: VersionSet | None = None
    restore_s: float = 60.0
    cold_start_s: float = 1200.0
    since_start_s: float = 0.0
    remaining_s: float | None = None


@dataclass(frozen=True, slots=True)
class Fleet:
    nodes: tuple[Node, ...]
    workloads: tuple[Workload, ...]

    def __post_init__(self) -> None:
        _check_fleet(self)


def _check_fleet(fleet: Fleet) -> None:
    free: dict[str, int] = {}
    for node in fleet.nodes:
        if node.name in free:
            raise ConfigError(f"node {node.name!r} is listed twice", hint="give every node a unique name")
        if node.gpus < 1:
            raise ConfigError(f"node {node.name!r} has {node.gpus} GPUs", hint="list only GPU nodes")
        free[node.name] = node.gpus
    seen: set[str] = set()
    for w in fleet.workloads:
        if w.name in seen:
            raise ConfigError(f"workload {w.name!r} is listed twice", hint="give every workload a unique name")
        seen.add(w.name)
        if w.node not in free:
            raise ConfigError(f"workload {w.name!r} runs on unknown node {w.node!r}", hint="add the node")
        if w.gpus < 1:
            raise ConfigError(f"workload {w.name!r} asks for {w.gpus} GPUs", hint="list only GPU workloads")
        free[w.node] -= w.gpus
        if free[w.node] < 0:
            raise ConfigError(
                f"node {w.node!r} runs more GPUs than it has", hint="fix the workloads' gpus or the node's gpus"
            )


@dataclass(frozen=True, slots=True)
class Change:
    """The planned change: target versions (None = unchanged) and how long one node's upgrade takes."""

    target: VersionSet
    node_upgrade_s: float = 900.0  # driver reload plus validation, which the operator lets run up to 600 s

    def __post_init__(self) -> None:
        if not self.target.recorded():
            raise ConfigError(
                "the change moves no component",
                hint=f"name at least one, e.g. driver=580.95.05 (components: {COMPONENTS})",
            )
        if not self.node_upgrade_s > 0:
            raise ConfigError(f"node upgrade time {self.node_upgrade_s} s is not positive", hint="give seconds > 0")

    def apply(self, versions: VersionSet) -> VersionSet:
        return dataclasses.replace(versions, **{c.value: v for c, v in self.target.recorded()})

    def is_current(self, versions: VersionSet) -> bool:
        return all(versions.get(c) == v for c, v in self.target.recorded())


def parse_change(items: list[str] | tuple[str, ...], *, node_upgrade_s: float = 900.0) -> Change:
    """`["driver=580.95.05", "cuda=13.0"]` -> Change; an unknown component is a ConfigError."""
    target: dict[str, str] = {}
    for item in items:
        name, sep, version = item.partition("=")
        if not sep or not version.strip():
            raise ConfigError(f"change {item!r} is not COMPONENT=VERSION", hint="e.g. driver=580.95.05")
        if name.strip() not in {c.value for c in Component}:
            raise ConfigError(f"unknown component {name.strip()!r} in change {item!r}", hint=f"use one of {COMPONENTS}")
        target[name.strip()] = version.strip()
    return Change(target=VersionSet(**target), node_upgrade_s=node_upgrade_s)


@dataclass(frozen=True, slots=True)
class SweepLimits:
    """Wave limits, read as the GPU Operator's upgrade policy reads them.

    `max_parallel` 0 means no limit (as `maxParallelUpgrades: 0`); `max_unavailable` is a node count
    or a percentage of all nodes, rounded up (as the operator's `maxUnavailable`); `hold_back_gpus`
    is, per old (GPU model, version set), the GPUs kept on the old versions until the end of the sweep
    so moved work has somewhere to restore; their own work crosses to the new stack directly.
    """

    max_parallel: int = 1
    max_unavailable: str = "25%"
    hold_back_gpus: int = 0

    def __post_init__(self) -> None:
        if self.max_parallel < 0:
            raise ConfigError(f"max parallel {self.max_parallel} is negative", hint="use 0 (no limit) or more")
        if self.hold_back_gpus < 0:
            raise ConfigError(f"hold-back {self.hold_back_gpus} GPUs is negative", hint="use 0 or more")
        _unavailable_fraction(self.max_unavailable)

    def wave_size(self, node_count: int) -> int:
        fraction = _unavailable_fraction(self.max_unavailable)
        if isinstance(fraction, float):
            unavailable = math.ceil(round(fraction * node_count, 9))
        else:
            unavailable = fraction
        parallel = self.max_parallel or node_count
        return max(1, min(parallel, unavailable, node_count))


def _unavailable_fraction(value: str) -> int | float:
    text = str(value).strip()
    try:
        number = float(text[:-1]) / 100.0 if text.endswith("%") else int(text)
    except ValueError:
        raise ConfigError(f"max unavailable {value!r} is not a count or a percentage", hint="e.g. 2 or 25%") from None
    if not number > 0:  # also NaN
        raise ConfigError(f"max unavailable {value!r} lets no node upgrade", hint="use at least 1 or 1%")
    if isinstance(number, float) and not number <= 1.0:
        raise ConfigError(f"max unavailable {value!r} is over 100%", hint="use a percentage up to 100% or a count")
    return number


class CheckpointFate(enum.StrEnum):
    """What the change does to a workload's checkpoint: one value per row of the field note's table."""

    OLD_SET_ONLY = "old-set-only"  # driver / CUDA / engine changed: restores on old nodes only
    NEW_VERSION_COLD_START = "new-version-cold-start"  # model changed: invalid everywhere
    RESTORES_ANYWHERE = "restores-anywhere"  # nothing recorded changed
    NO_CHECKPOINT = "no-checkpoint"  # none held: it can only cold start


def checkpoint_fate(checkpoint: VersionSet | None, change: Change) -> CheckpointFate:
    if checkpoint is None:
        return CheckpointFate.NO_CHECKPOINT
    new_model = change.target.model
    if new_model is not None and checkpoint.model is not None and checkpoint.model != new_model:
        return CheckpointFate.NEW_VERSION_COLD_START
    if all(checkpoint.get(c) in (None, v) for c, v in change.target.recorded()):
        return CheckpointFate.RESTORES_ANYWHERE
    return CheckpointFate.OLD_SET_ONLY


def restores_on(checkpoint: VersionSet | None, versions: VersionSet, change: Change) -> bool:
    """True when a checkpoint restores on a node with `versions` (the GPU model is checked by the caller)."""
    if checkpoint_fate(checkpoint, change) is CheckpointFate.NEW_VERSION_COLD_START or checkpoint is None:
        return False
    return all(versions.get(c) == v for c, v in checkpoint.recorded())


class MoveKind(enum.StrEnum):
    RESTORE = "restore"
    COLD_START = "cold-start"


@dataclass(frozen=True, slots=True)
class Move:
    """One workload leaving a draining node: stopped at `stop_s`, running again at `ready_s`."""

    wave: int
    workload: str
    from_node: str
    to_node: str
    kind: MoveKind
    stop_s: float
    start_s: float  # when the restore or cold start begins on `to_node` (later than stop_s if it waited)
    ready_s: float
    lost_gpu_s: float  # GPU-seconds of in-memory work destroyed (0 for a restore)


@dataclass(frozen=True, slots=True)
class Wave:
    index: int
    start_s: float
    end_s: float
    nodes: tuple[str, ...]
    moves: tuple[Move, ...]
    finished: tuple[str, ...]  # workloads that completed on their own before this wave started
    old_gpus_left: int  # GPUs on nodes still on the old versions after this wave
    old_gpus_used: int  # of which held by running workloads


@dataclass(frozen=True, slots=True)
class SweepPlan:
    change: Change
    limits: SweepLimits
    wave_size: int
    waves: tuple[Wave, ...]
    cold_starts: int
    restores: int
    duration_s: float  # plan clock: seconds from the first wave's start to the last ready workload
    lost_gpu_h: float
    downtime_gpu_h: float  # GPU-hours of workload demand not running (stopped until ready)
    idle_gpu_h: float  # upgrading nodes plus GPUs held by restores and cold starts


class ShortfallKind(enum.StrEnum):
    NO_OLD_CAPACITY = "no-old-capacity"  # the checkpoint restores only on the old set, and it is full
    NO_NEW_CAPACITY = "no-new-capacity"  # nothing on the new stack fits, even after this wave's upgrade


@dataclass(frozen=True, slots=True)
class Shortfall:
    wave: int
    kind: ShortfallKind
    gpu_model: str
    versions: VersionSet  # the set the workloads needed (checkpoint set, or the new stack)
    workloads: tuple[str, ...]
    gpus: int


@dataclass(frozen=True, slots=True)
class Infeasible:
    """Why no plan exists, and the smallest hold-back found that gives one (None if none does)."""

    change: Change
    limits: SweepLimits
    shortfalls: tuple[Shortfall, ...]
    hold_back_fix_gpus: int | None


class NoSweepPlanError(GpucanaryError):
    """No sweep fits the fleet under these limits; `infeasible` says where and what would fix it."""

    def __init__(self, infeasible: Infeasible) -> None:
        super().__init__(describe_shortfall(infeasible.shortfalls[0]), hint=_fix_hint(infeasible))
        self.infeasible = infeasible


def describe_shortfall(s: Shortfall) -> str:
    names = ", ".join(s.workloads[:3]) + (" ..." if len(s.workloads) > 3 else "")
    who = f"{names} ({len(s.workloads)} workload(s), {s.gpus} GPUs of {s.gpu_model})"
    if s.kind is ShortfallKind.NO_OLD_CAPACITY:
        return f"no sweep plan: wave {s.wave}: {who} restore only on {s.versions.label()}, which has no room left"
    return f"no sweep plan: wave {s.wave}: {who} find no room on the new stack {s.versions.label()}"


def _fix_hint(infeasible: Infeasible) -> str:
    fix = infeasible.hold_back_fix_gpus
    if fix is None:
        return "no hold-back fixes it; add capacity of that GPU model or lower the load before the sweep"
    return f"hold back {fix} GPUs per old version set (--hold-back-gpus {fix})"
