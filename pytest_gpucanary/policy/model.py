"""An upgrade policy in the CR's shape: `UpgradePolicy` and its blocks, the kinds of document that carry it
and where (`SourceKind`, the paths), and the checks each value passes, one table per block serving parsing
and `to_cr()`; a fault is a `ConfigError` at its place in the document (`At`). The two settings that leave
nothing to upgrade, autoUpgrade false and sandbox workloads on, are refused here with the same checks.
Pure; `policy.parse` reads documents into it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.policy.render import Rendering


class SourceKind(enum.StrEnum):
    CLUSTER_POLICY = "ClusterPolicy"
    NVIDIA_DRIVER = "NVIDIADriver"
    HELM_VALUES = "HelmValues"


API_VERSIONS = {SourceKind.CLUSTER_POLICY: "nvidia.com/v1", SourceKind.NVIDIA_DRIVER: "nvidia.com/v1alpha1"}
POLICY_PATHS = {
    SourceKind.CLUSTER_POLICY: ("spec", "driver", "upgradePolicy"),
    SourceKind.NVIDIA_DRIVER: ("spec", "upgradePolicy"),
    SourceKind.HELM_VALUES: ("driver", "upgradePolicy"),
}
VERSION_PATHS = {
    SourceKind.CLUSTER_POLICY: ("spec", "driver", "version"),
    SourceKind.NVIDIA_DRIVER: ("spec", "version"),
    SourceKind.HELM_VALUES: ("driver", "version"),
}
# Same effect as autoUpgrade false; NVIDIADriver has no such switch.
SANDBOX_PATHS = {
    SourceKind.CLUSTER_POLICY: ("spec", "sandboxWorkloads", "enabled"),
    SourceKind.HELM_VALUES: ("sandboxWorkloads", "enabled"),
}
HELM_POD_DELETION = "gpuPodDeletion"


@dataclass(frozen=True, slots=True)
class WaitForCompletion:
    pod_selector: str = ""  # "" skips the wait step
    timeout_s: int = 0  # 0 waits forever; expiry moves on to pod deletion, it is not a failure


@dataclass(frozen=True, slots=True)
class PodDeletion:
    force: bool = False
    timeout_s: int = 300  # 0 waits forever
    delete_empty_dir: bool = False


@dataclass(frozen=True, slots=True)
class Drain:
    enable: bool = False
    force: bool = False
    pod_selector: str = ""
    timeout_s: int = 300  # 0 waits forever
    delete_empty_dir: bool = False


@dataclass(frozen=True, slots=True)
class UpgradePolicy:
    """`DriverUpgradePolicySpec` (k8s-operator-libs), every field explicit, plus where it came from."""

    auto_upgrade: bool
    max_parallel_upgrades: int  # 0 = no limit
    max_unavailable: int | str  # a node count, or "N%" of driver nodes rounded up
    wait_for_completion: WaitForCompletion
    pod_deletion: PodDeletion
    drain: Drain
    source_kind: SourceKind
    driver_version: str | None = None  # the driver version the document names, if any
    rendering: Rendering | None = None  # Helm values: the chart that rendered the CR, and what it filled in

    def to_cr(self) -> dict[str, Any]:
        """The `upgradePolicy` mapping to write into a ClusterPolicy or an NVIDIADriver."""
        return {
            "autoUpgrade": self.auto_upgrade,
            "maxParallelUpgrades": self.max_parallel_upgrades,
            "maxUnavailable": self.max_unavailable,
            "waitForCompletion": _cr_block(self.wait_for_completion, WAIT_FIELDS),
            "podDeletion": _cr_block(self.pod_deletion, POD_DELETION_FIELDS),
            "drain": _cr_block(self.drain, DRAIN_FIELDS),
        }

    def knobs(self) -> dict[str, Any]:
        """`to_cr()` flat: {"drain.enable": False, ...}."""
        return flat_knobs(self.to_cr())

    def path_of(self, knob: str) -> str:
        """Where a CR-shaped key such as `podDeletion.timeoutSeconds` sits in the source document."""
        if self.source_kind is SourceKind.HELM_VALUES and knob.split(".")[0] == "podDeletion":
            knob = HELM_POD_DELETION + knob[len("podDeletion") :]
        return ".".join((*POLICY_PATHS[self.source_kind], knob))


@dataclass(frozen=True, slots=True)
class At:
    """A place in the document, for messages: `<source>: <yaml path> <problem>; <what to do>`."""

    source: str
    path: str

    def child(self, key: str) -> At:
        return At(self.source, f"{self.path}.{key}")

    def error(self, problem: str, *, hint: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.path} {problem}", hint=hint)


def shown(value: Any) -> str:
    if value is None:
        return "empty (null)"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _bool(value: Any, at: At) -> bool:
    if isinstance(value, bool):
        return value
    raise at.error(f"is {shown(value)}, not a boolean", hint="write true or false, without quotes")


def whole(value: Any, at: At, *, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise at.error(f"is {shown(value)}, not a whole number", hint=hint)
    if value < 0:
        raise at.error(f"is {value}, below 0", hint=hint)
    return value


def _seconds(value: Any, at: At) -> int:
    return whole(value, at, hint="write seconds such as 300 (0 waits forever)")


def _selector(value: Any, at: At) -> str:
    if isinstance(value, str):
        return value
    raise at.error(
        f"is {shown(value)}, not a label selector", hint='write a selector such as "app=trainer", or "" for none'
    )


def max_unavailable(value: Any, at: At) -> int | str:
    hint = 'write a node count such as 1, or a quoted percentage such as "25%"'
    if isinstance(value, int) and not isinstance(value, bool):
        return whole(value, at, hint=hint)
    if isinstance(value, str) and re.fullmatch(r"[0-9]+%", value):
        if int(value[:-1]) > 100:
            raise at.error(f"is {value}, above 100%", hint=hint)
        return value
    if isinstance(value, str) and value.strip().isdigit():
        # intstr reads a string without "%" as a malformed percentage and the reconcile fails.
        raise at.error(
            f"is {shown(value)}, which the operator rejects (neither a count nor a percentage)",
            hint=f"write {value.strip()} without quotes, or {value.strip()}%",
        )
    raise at.error(f"is {shown(value)}, not a node count or a percentage", hint=hint)


Check = Callable[[Any, At], Any]
# CR key -> (dataclass field, check); one table serves parsing and to_cr().
WAIT_FIELDS: dict[str, tuple[str, Check]] = {
    "podSelector": ("pod_selector", _selector),
    "timeoutSeconds": ("timeout_s", _seconds),
}
POD_DELETION_FIELDS: dict[str, tuple[str, Check]] = {
    "force": ("force", _bool),
    "timeoutSeconds": ("timeout_s", _seconds),
    "deleteEmptyDir": ("delete_empty_dir", _bool),
}
DRAIN_FIELDS: dict[str, tuple[str, Check]] = {
    "enable": ("enable", _bool),
    "force": ("force", _bool),
    "podSelector": ("pod_selector", _selector),
    "timeoutSeconds": ("timeout_s", _seconds),
    "deleteEmptyDir": ("delete_empty_dir", _bool),
}
POLICY_FIELDS = ("autoUpgrade", "maxParallelUpgrades", "maxUnavailable", "waitForCompletion", "podDeletion", "drain")


def _cr_block(block: Any, fields: Mapping[str, tuple[str, Check]]) -> dict[str, Any]:
    return {key: getattr(block, attr) for key, (attr, _) in fields.items()}


def flat_knobs(cr: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested upgradePolicy mapping with dotted keys: {"drain": {"enable": x}} -> {"drain.enable": x}."""
    flat: dict[str, Any] = {}
    for key, value in cr.items():
        if isinstance(value, Mapping):
            flat.update(flat_knobs(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def dig(doc: Mapping[str, Any], path: tuple[str, ...], source: str) -> Any:
    """The value at `path`, None if any part is absent; a part that is not a mapping is an error."""
    value: Any = doc
    for depth, key in enumerate(path):
        if value is None:
            return None
        if not isinstance(value, Mapping):
            at = At(source, ".".join(path[:depth]))
            raise at.error(f"is {shown(value)}, not a mapping", hint=f"nest {'.'.join(path[depth:])} under it")
        value = value.get(key)
    return value


AUTO_UPGRADE_OFF = (
    "the upgrade controller then removes nvidia.com/gpu-driver-upgrade-state from every node and "
    "upgrades nothing, so a canary cannot test this policy"
)


def auto_upgrade(raw: Mapping[str, Any], at: At, kind: SourceKind) -> bool:
    if "autoUpgrade" not in raw and kind is SourceKind.CLUSTER_POLICY:
        raise at.child("autoUpgrade").error(
            f"is missing and the ClusterPolicy CRD defaults it to false: {AUTO_UPGRADE_OFF}",
            hint="write autoUpgrade: true",
        )
    if not _bool(raw.get("autoUpgrade", True), at.child("autoUpgrade")):
        raise at.child("autoUpgrade").error(f"is false: {AUTO_UPGRADE_OFF}", hint="write autoUpgrade: true")
    return True


def refuse_sandbox_workloads(doc: Mapping[str, Any], kind: SourceKind, source: str) -> None:
    path = SANDBOX_PATHS.get(kind)
    if path is None:
        return
    value = dig(doc, path, source)
    at = At(source, ".".join(path))
    if value is not None and _bool(value, at):
        raise at.error(f"is true: {AUTO_UPGRADE_OFF}", hint="write sandboxWorkloads.enabled: false for the canary")
