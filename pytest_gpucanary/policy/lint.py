"""Lint of valid upgrade policies: the predicted blast radius and the legal-but-risky traps.

Pure: takes `UpgradePolicy` records (from `policy.model`) and returns findings; never touches a cluster.
Each rule reads only the CR keys it declares in `knobs`, so a diff can say which changed knob
introduced or removed a finding. The facts behind the rules are the upgrade controller's
(k8s-operator-libs `pkg/upgrade`, as vendored by gpu-operator v25.3.4 to v25.10.1):
- pod deletion touches only pods requesting `nvidia.com/gpu*`; if the helper would skip one of
  them (emptyDir without deleteEmptyDir, unmanaged without force), the step fails;
- a failed pod deletion goes to drain when `drain.enable`, else to `upgrade-failed`;
- a drain evicts every non-DaemonSet pod matching `drain.podSelector`, GPU or not;
- an `upgrade-failed` node counts as in progress and stays cordoned.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pytest_gpucanary.policy.model import UpgradePolicy


class Severity(enum.StrEnum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True, slots=True)
class Finding:
    severity: Severity
    code: str  # stable id, e.g. "drain-evicts-non-gpu"
    message: str  # one line: what happens, then what to do
    path: str  # where the deciding knob sits in the source document

    def line(self) -> str:
        return f"{self.severity} {self.code} {self.path}: {self.message}"


@dataclass(frozen=True, slots=True)
class _Flag:
    severity: Severity
    message: str


@dataclass(frozen=True, slots=True)
class Rule:
    code: str
    knobs: tuple[str, ...]  # every CR key the check reads; the finding points at the first
    check: Callable[[UpgradePolicy], _Flag | None]
    source: str  # where the behaviour it warns of is written down (the docs' rules table shows it)


RULES: list[Rule] = []


def _rule(code: str, *knobs: str, source: str) -> Callable[[Callable[[UpgradePolicy], _Flag | None]], Rule]:
    def register(check: Callable[[UpgradePolicy], _Flag | None]) -> Rule:
        RULES.append(rule := Rule(code, knobs, check, source))
        return rule

    return register


@_rule(
    "auto-upgrade-off",
    "autoUpgrade",
    source="k8s-operator-libs upgrade state machine: autoUpgrade false clears every node's upgrade state",
)
def _auto_upgrade_off(p: UpgradePolicy) -> _Flag | None:
    if p.auto_upgrade:
        return None
    return _Flag(
        Severity.ERROR,
        "the controller removes the upgrade-state label from every node and upgrades nothing; set autoUpgrade: true",
    )


@_rule(
    "drain-evicts-non-gpu",
    "drain.enable",
    "drain.podSelector",
    source="the field note this canary comes from (a drain took a scheduler API pod off a GPU worker); "
    "k8s-operator-libs drain: every non-DaemonSet pod the selector matches",
)
def _drain_evicts_non_gpu(p: UpgradePolicy) -> _Flag | None:
    if not p.drain.enable:
        return None
    if p.drain.pod_selector:
        return _Flag(
            Severity.WARNING,
            "a failed GPU pod deletion falls back to a drain that evicts every "
            f"non-DaemonSet pod matching {p.drain.pod_selector!r}, GPU or not; "
            "make sure no non-GPU service matches it",
        )
    return _Flag(
        Severity.ERROR,
        "a failed GPU pod deletion falls back to a drain that evicts every non-DaemonSet "
        "pod on the node, GPU or not (e.g. a scheduler API pod); set drain.enable: false "
        "or narrow drain.podSelector",
    )


@_rule(
    "driver-holders-not-freed",
    "drain.enable",
    source="NVIDIA/gpu-operator #2570, #2509, #2549, #2166; k8s-driver-manager v0.12.0 autoDrainSupersededByPolicyMsg",
)
def _driver_holders_not_freed(p: UpgradePolicy) -> _Flag | None:
    # k8s-driver-manager's own ENABLE_AUTO_DRAIN is superseded once an upgrade policy is on (its
    # autoDrainSupersededByPolicyMsg), so no knob here frees them (NVIDIA/gpu-operator #2570, #2509)
    then = (
        "a drain evicts them only after a GPU pod deletion failed, and never DaemonSet pods"
        if p.drain.enable
        else "drain is off"
    )
    return _Flag(
        Severity.INFO,
        "pod deletion removes only pods that request a GPU: a pod that holds the driver "
        "without one (NVIDIA_VISIBLE_DEVICES, RuntimeClass nvidia) keeps it loaded, the new "
        f"driver pod crash-loops and the node never reaches upgrade-done ({then}; "
        "NVIDIA/gpu-operator #2570); keep such pods off GPU nodes during the upgrade, and "
        "show it with --gpucanary-holder",
    )


@_rule(
    "dra-claims-not-deleted",
    "drain.enable",
    source="GPU Operator cmd/gpu-operator/main.go gpuPodSpecFilter: v26.7.0 is the first to count a pod with "
    "an allocated gpu.nvidia.com claim (PodHasNVIDIAGPUClaim); v26.3.3 and before match nvidia.com/gpu "
    "and nvidia.com/mig-* resources only",
)
def _dra_claims_not_deleted(p: UpgradePolicy) -> _Flag | None:
    # the operator's pod deletion filter (gpuPodSpecFilter) before v26.7 matches extended resources only;
    # v26.7.0 also counts a pod with an allocated gpu.nvidia.com ResourceClaim (pytest_gpucanary/canary/dra.py)
    then = (
        "a drain evicts them only after a GPU pod deletion failed"
        if p.drain.enable
        else "drain is off, so nothing removes them"
    )
    return _Flag(
        Severity.INFO,
        "before GPU Operator v26.7, pod deletion never deletes a pod that holds its GPU "
        f"through a DRA ResourceClaim (gpu.nvidia.com): {then}, and the driver cannot unload "
        "while one runs; on a DRA cluster run the operator v26.7 or later, or test with drain",
    )


@_rule(
    "emptydir-blocks-pod-deletion",
    "podDeletion.deleteEmptyDir",
    "drain.enable",
    source="k8s-operator-libs upgrade state machine: pod deletion refuses emptyDir pods unless deleteEmptyDir",
)
def _emptydir_blocks_pod_deletion(p: UpgradePolicy) -> _Flag | None:
    if p.pod_deletion.delete_empty_dir:
        return None
    then = "the node falls back to a full drain" if p.drain.enable else "the node goes to upgrade-failed"
    return _Flag(
        Severity.WARNING,
        "GPU pods with an emptyDir volume (PyTorch's /dev/shm) fail pod deletion and "
        f"{then}; set podDeletion.deleteEmptyDir: true",
    )


@_rule(
    "pod-deletion-loses-emptydir",
    "podDeletion.deleteEmptyDir",
    source="k8s-operator-libs upgrade state machine: pod deletion",
)
def _pod_deletion_loses_emptydir(p: UpgradePolicy) -> _Flag | None:
    if not p.pod_deletion.delete_empty_dir:
        return None
    return _Flag(
        Severity.INFO,
        "deleted GPU pods lose their emptyDir data (fine for /dev/shm, not for a scratch "
        "checkpoint); non-GPU pods are not touched",
    )


@_rule(
    "drain-aborts-on-emptydir",
    "drain.deleteEmptyDir",
    "drain.enable",
    source="kubectl drain helper: emptyDir pods abort the drain unless DeleteEmptyDirData",
)
def _drain_aborts_on_emptydir(p: UpgradePolicy) -> _Flag | None:
    if not p.drain.enable or p.drain.delete_empty_dir:
        return None
    return _Flag(
        Severity.WARNING,
        "a drain aborts before evicting anything if any selected pod has an emptyDir, so "
        "the node goes to upgrade-failed; set drain.deleteEmptyDir: true or disable drain",
    )


@_rule(
    "drain-loses-emptydir", "drain.deleteEmptyDir", "drain.enable", source="kubectl drain helper: DeleteEmptyDirData"
)
def _drain_loses_emptydir(p: UpgradePolicy) -> _Flag | None:
    if not (p.drain.enable and p.drain.delete_empty_dir):
        return None
    return _Flag(Severity.INFO, "a drain deletes the emptyDir data of every pod it evicts, GPU or not")


@_rule(
    "pod-deletion-waits-forever",
    "podDeletion.timeoutSeconds",
    source="k8s-operator-libs upgrade state machine: timeoutSeconds 0 is infinite",
)
def _pod_deletion_waits_forever(p: UpgradePolicy) -> _Flag | None:
    if p.pod_deletion.timeout_s:
        return None
    return _Flag(
        Severity.WARNING,
        "0 waits forever: a PodDisruptionBudget that never allows the eviction keeps "
        "the node cordoned, with no fallback and no upgrade-failed; set e.g. 300",
    )


@_rule(
    "drain-waits-forever", "drain.timeoutSeconds", "drain.enable", source="kubectl drain helper: Timeout 0 is infinite"
)
def _drain_waits_forever(p: UpgradePolicy) -> _Flag | None:
    if not p.drain.enable or p.drain.timeout_s:
        return None
    return _Flag(
        Severity.WARNING,
        "0 waits forever: a PodDisruptionBudget that never allows the eviction keeps "
        "the node cordoned and draining; set e.g. 300",
    )


@_rule(
    "wait-for-completion-forever",
    "waitForCompletion.timeoutSeconds",
    "waitForCompletion.podSelector",
    source="k8s-operator-libs upgrade state machine: waitForCompletion timeoutSeconds 0 is infinite",
)
def _wait_forever(p: UpgradePolicy) -> _Flag | None:
    wait = p.wait_for_completion
    if not wait.pod_selector or wait.timeout_s:
        return None
    return _Flag(
        Severity.WARNING,
        f"a pod matching {wait.pod_selector!r} that never finishes keeps the node "
        "cordoned forever; set a timeout (its expiry moves on to pod deletion)",
    )


@_rule(
    "wait-timeout-is-not-failure",
    "waitForCompletion.timeoutSeconds",
    "waitForCompletion.podSelector",
    source="k8s-operator-libs upgrade state machine: an expired wait moves on to pod deletion",
)
def _wait_timeout_is_not_failure(p: UpgradePolicy) -> _Flag | None:
    wait = p.wait_for_completion
    if not wait.pod_selector or not wait.timeout_s:
        return None
    return _Flag(
        Severity.INFO,
        f"after {wait.timeout_s} s (checked only at reconciles, up to ~2 min late) the "
        "upgrade stops waiting and deletes the still-running GPU pods; it is not a failure",
    )


@_rule(
    "max-unavailable-zero",
    "maxUnavailable",
    source="k8s-operator-libs upgrade state machine: maxUnavailable caps nodes that may be cordoned",
)
def _max_unavailable_zero(p: UpgradePolicy) -> _Flag | None:
    if p.max_unavailable not in (0, "0%"):
        return None
    return _Flag(
        Severity.ERROR,
        '0 lets no node start an upgrade; only nodes already cordoned move on; set 1 or a percentage such as "25%"',
    )


@_rule(
    "no-parallel-limit",
    "maxParallelUpgrades",
    source="k8s-operator-libs upgrade state machine: maxParallelUpgrades 0 is unlimited",
)
def _no_parallel_limit(p: UpgradePolicy) -> _Flag | None:
    if p.max_parallel_upgrades:
        return None
    return _Flag(
        Severity.WARNING,
        "0 means no limit: every node that needs the upgrade starts at once, capped only "
        "by maxUnavailable; set 1 or a small number",
    )


@_rule(
    "failed-node-blocks-others",
    "maxParallelUpgrades",
    source="k8s-operator-libs upgrade state machine: upgrade-failed counts as in progress",
)
def _failed_node_blocks_others(p: UpgradePolicy) -> _Flag | None:
    if p.max_parallel_upgrades != 1:
        return None
    return _Flag(
        Severity.INFO,
        "an upgrade-failed node counts as in progress and stays cordoned, so one failure "
        "stops every other node until someone clears it",
    )


@_rule(
    "pod-deletion-force-deletes-unmanaged",
    "podDeletion.force",
    source="k8s-operator-libs upgrade state machine: pod deletion force",
)
def _pod_deletion_force(p: UpgradePolicy) -> _Flag | None:
    if not p.pod_deletion.force:
        return None
    return _Flag(
        Severity.WARNING,
        "unmanaged GPU pods (no controller owner) are deleted and nothing recreates them; "
        "set podDeletion.force: false unless that is intended",
    )


@_rule(
    "drain-force-deletes-unmanaged",
    "drain.force",
    "drain.enable",
    source="kubectl drain helper: Force deletes unmanaged pods",
)
def _drain_force(p: UpgradePolicy) -> _Flag | None:
    if not (p.drain.enable and p.drain.force):
        return None
    return _Flag(
        Severity.WARNING,
        "a drain deletes unmanaged pods, GPU or not, and nothing recreates them; "
        "set drain.force: false unless that is intended",
    )


def lint_policy(policy: UpgradePolicy) -> list[Finding]:
    """Every finding, errors first, then in rule order."""
    findings = [
        Finding(flag.severity, rule.code, flag.message, policy.path_of(rule.knobs[0]))
        for rule in RULES
        if (flag := rule.check(policy)) is not None
    ]
    order = list(Severity)
    return sorted(findings, key=lambda f: order.index(f.severity))


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity is Severity.ERROR for f in findings)
