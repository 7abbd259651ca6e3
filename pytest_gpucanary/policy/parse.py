"""Upgrade policies: read a ClusterPolicy, an NVIDIADriver or gpu-operator Helm values into one
frozen `UpgradePolicy` in the CR's shape, and refuse the documents the operator would mishandle.
The record and the checks of its values are in `policy.model`; this module reads the documents.

Pure: takes text and returns records. Never imports `kubernetes` or `kube`; writing the policy
into the cluster belongs to `canary.apply`, which takes `UpgradePolicy.to_cr()`. The lint of legal
but risky policies is in `policy.lint`. Every fault is a one-line `ConfigError` naming the
document path (`spec.driver.upgradePolicy.drain.timeoutSeconds`) and what to write instead.
Helm values are never read by imitating the chart: the values file is checked for what it says,
then a `ValuesRenderer` (real `helm template`, `policy.helm`) renders it with the chart, and the
rendered ClusterPolicy is parsed like any other (`policy.render` picks it out and notes the knobs
the chart filled in or changed).

Where the policy lives (gpu-operator v25.3.4, the fleet's; v25.10.1 reads it the same way):
  ClusterPolicy  nvidia.com/v1        spec.driver.upgradePolicy
  NVIDIADriver   nvidia.com/v1alpha1  spec.upgradePolicy (operator v26.7 and later only)
  Helm values    no apiVersion/kind   driver.upgradePolicy, with `gpuPodDeletion` where the CR
                                      has `podDeletion` (the chart's template renames it)
Defaults are the CRD's for a CR; for Helm values, whatever the chart renders. A CR must carry
`drain` and `podDeletion` itself: the CRD gives them no default (see `_required_block`). Helm values
may leave them out, because the chart's own values fill them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_gpucanary.config import flag
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.policy.model import (
    API_VERSIONS,
    DRAIN_FIELDS,
    HELM_POD_DELETION,
    POD_DELETION_FIELDS,
    POLICY_FIELDS,
    POLICY_PATHS,
    VERSION_PATHS,
    WAIT_FIELDS,
    At,
    Check,
    Drain,
    PodDeletion,
    SourceKind,
    UpgradePolicy,
    WaitForCompletion,
    auto_upgrade,
    dig,
    flat_knobs,
    max_unavailable,
    refuse_sandbox_workloads,
    shown,
    whole,
)
from pytest_gpucanary.policy.render import Rendering, ValuesRenderer, chart_notes, pick_cluster_policy
from pytest_gpucanary.user_files import yaml_documents

ACCEPTED_KINDS = "a ClusterPolicy (nvidia.com/v1), an NVIDIADriver (nvidia.com/v1alpha1) or gpu-operator Helm values"
EXAMPLES = "see fixtures/policies/"


def load_policy(path: str | Path, *, helm: ValuesRenderer | None = None) -> UpgradePolicy:
    """Read and validate a policy file (examples in fixtures/policies/); Helm values need `helm`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(
            f"cannot read policy {str(path)!r}: {err.strerror}",
            hint="check the path; it names a ClusterPolicy, NVIDIADriver or Helm values file",
        ) from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"policy {str(path)!r} is not UTF-8 text", hint="give a YAML file") from err
    return parse_policy(text, source=str(path), helm=helm)


def parse_policy(text: str, *, source: str = "<policy>", helm: ValuesRenderer | None = None) -> UpgradePolicy:
    """Validate one YAML document and normalise its upgrade policy to the CR shape. Helm values are
    checked, then rendered by `helm`, and the policy is the rendered ClusterPolicy's."""
    doc = _load_yaml(text, source)
    kind = _kind(doc, source)
    if kind is SourceKind.HELM_VALUES:
        return _rendered_policy(text, doc, source, helm)
    return _parse_cr(doc, kind, source)


def _parse_cr(doc: Mapping[str, Any], kind: SourceKind, source: str) -> UpgradePolicy:
    at = At(source, ".".join(POLICY_PATHS[kind]))
    raw = dig(doc, POLICY_PATHS[kind], source)
    if raw is None:
        raise at.error("is missing", hint=_MISSING_POLICY_HINTS[kind])
    policy = _policy(raw, at, kind, driver_version=_driver_version(doc, kind, source))
    refuse_sandbox_workloads(doc, kind, source)
    return policy


_MISSING_POLICY_HINTS = {
    SourceKind.CLUSTER_POLICY: "without it the CRD leaves autoUpgrade false and nothing is upgraded; "
    f"write the whole block ({EXAMPLES}default.yaml)",
    SourceKind.NVIDIA_DRIVER: "an NVIDIADriver carries its own policy from operator v26.7; before that it belongs in "
    f"ClusterPolicy spec.driver.upgradePolicy ({EXAMPLES}nvidiadriver.yaml)",
    SourceKind.HELM_VALUES: "a document without apiVersion and kind is read as gpu-operator Helm values; "
    f"write driver.upgradePolicy ({EXAMPLES}helm-values.yaml)",
}


def _load_yaml(text: str, source: str) -> Mapping[str, Any]:
    docs = yaml_documents(text, source=source)
    if len(docs) > 1:
        raise ConfigError(f"{source} holds {len(docs)} YAML documents", hint=f"give one: {ACCEPTED_KINDS}")
    doc = docs[0] if docs else None
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source} is {shown(doc)}, not a YAML mapping", hint=f"give {ACCEPTED_KINDS}")
    return doc


def _kind(doc: Mapping[str, Any], source: str) -> SourceKind:
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if kind is None and api_version is None:
        return SourceKind.HELM_VALUES
    if not isinstance(kind, str) or kind not in API_VERSIONS:
        raise ConfigError(f"{source}: kind {kind!r} is not an upgrade policy document", hint=f"give {ACCEPTED_KINDS}")
    if api_version != API_VERSIONS[SourceKind(kind)]:
        raise ConfigError(
            f"{source}: apiVersion {api_version!r} does not serve kind {kind}",
            hint=f"write apiVersion: {API_VERSIONS[SourceKind(kind)]}",
        )
    return SourceKind(kind)


def _fields(raw: Any, at: At, accepted: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise at.error(f"is {shown(raw)}, not a mapping", hint=f"write its fields: {', '.join(accepted)}")
    unknown = sorted(str(key) for key in raw if key not in accepted)
    if unknown:
        raise at.child(unknown[0]).error("is not a known field", hint=f"accepted: {', '.join(accepted)}")
    return raw


def _policy(raw: Any, at: At, kind: SourceKind, *, driver_version: str | None) -> UpgradePolicy:
    _refuse_other_shape_key(raw, at, kind)
    raw = _fields(raw, at, POLICY_FIELDS)
    wait_raw = raw.get("waitForCompletion", {})
    return UpgradePolicy(
        auto_upgrade=auto_upgrade(raw, at, kind),
        max_parallel_upgrades=whole(
            raw.get("maxParallelUpgrades", 1),
            at.child("maxParallelUpgrades"),
            hint="write a node count such as 1 (0 means no limit)",
        ),
        max_unavailable=max_unavailable(raw.get("maxUnavailable", "25%"), at.child("maxUnavailable")),
        wait_for_completion=_block(WaitForCompletion, wait_raw, at.child("waitForCompletion"), WAIT_FIELDS),
        pod_deletion=_required_block(
            PodDeletion, raw, at.child("podDeletion"), POD_DELETION_FIELDS, if_nil=NIL_POD_DELETION
        ),
        drain=_required_block(Drain, raw, at.child("drain"), DRAIN_FIELDS, if_nil=NIL_DRAIN),
        source_kind=kind,
        driver_version=driver_version,
    )


def _refuse_other_shape_key(raw: Any, at: At, kind: SourceKind) -> None:
    """Refuse the one key that Helm values and the CRs spell differently, used in the wrong shape."""
    if not isinstance(raw, Mapping):
        return
    if kind is not SourceKind.HELM_VALUES and HELM_POD_DELETION in raw:
        raise at.child(HELM_POD_DELETION).error(
            f"is the Helm values key; a {kind} has no such field", hint="rename it to podDeletion"
        )
    if kind is SourceKind.HELM_VALUES and "podDeletion" in raw:
        raise at.child("podDeletion").error(
            "is the CR key; the gpu-operator chart ignores it in Helm values", hint=f"rename it to {HELM_POD_DELETION}"
        )


def _block(cls: type, raw: Any, at: At, fields: Mapping[str, tuple[str, Check]]) -> Any:
    raw = _fields(raw, at, tuple(fields))
    return cls(**{attr: check(raw[key], at.child(key)) for key, (attr, check) in fields.items() if key in raw})


# What the operator does when the block is nil (absent from a CR, or null; in Helm values a null
# deletes the chart's default, and the chart's template then fails on it).
NIL_DRAIN = (
    "gpu-operator v25.10 and earlier panic in the upgrade controller on a nil drain (it reads drain.podSelector)"
)
NIL_POD_DELETION = (
    "the CRD gives it no default, so GPU pod deletion fails on every reconcile "
    "('pod deletion spec should not be empty') and nodes stay in pod-deletion-required"
)


def _required_block(
    cls: type, raw: Mapping[str, Any], at: At, fields: Mapping[str, tuple[str, Check]], *, if_nil: str
) -> Any:
    key = at.path.rsplit(".", 1)[1]
    if raw.get(key) is None:
        what = "is empty (null)" if key in raw else "is missing"
        example = ", ".join(f"{name}: {_example(attr)}" for name, (attr, _) in fields.items())
        raise at.error(f"{what}: {if_nil}", hint=f"write the block explicitly, e.g. {key}: {{{example}}}")
    return _block(cls, raw[key], at, fields)


def _example(attr: str) -> str:
    return {"timeout_s": "300", "pod_selector": '""'}.get(attr, "false")


def _rendered_policy(text: str, doc: Mapping[str, Any], source: str, helm: ValuesRenderer | None) -> UpgradePolicy:
    given = _check_values(doc, source)
    if helm is None:
        raise ConfigError(
            f"{source} is gpu-operator Helm values, which only the chart renders into a ClusterPolicy",
            hint=f"pass {flag('helm_chart')}=PATH (the gpu-operator chart of the cluster's release)",
        )
    rendered = helm.render(text, source=source)
    cluster_policy = pick_cluster_policy(rendered, source=source)
    policy = _parse_cr(cluster_policy, SourceKind.CLUSTER_POLICY, f"{source} as rendered by helm")
    policy = replace(policy, source_kind=SourceKind.HELM_VALUES)  # findings point into the values file
    return replace(
        policy, rendering=Rendering(rendered.chart, chart_notes(given, policy.knobs(), path_of=policy.path_of))
    )


_HELM_BLOCKS: dict[str, tuple[type, Mapping[str, tuple[str, Check]], str | None]] = {
    "waitForCompletion": (WaitForCompletion, WAIT_FIELDS, None),
    HELM_POD_DELETION: (PodDeletion, POD_DELETION_FIELDS, NIL_POD_DELETION),
    "drain": (Drain, DRAIN_FIELDS, NIL_DRAIN),
}


def _check_values(doc: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The knobs a Helm values file sets (flat, CR-shaped keys), each checked as the CR checks it.
    Nothing is filled in: what the file leaves out is the chart's to say."""
    kind = SourceKind.HELM_VALUES
    at = At(source, ".".join(POLICY_PATHS[kind]))
    raw = dig(doc, POLICY_PATHS[kind], source)
    if raw is None:
        raise at.error("is missing", hint=_MISSING_POLICY_HINTS[kind])
    _refuse_other_shape_key(raw, at, kind)
    raw = _fields(raw, at, tuple(HELM_POD_DELETION if key == "podDeletion" else key for key in POLICY_FIELDS))
    if "autoUpgrade" in raw:
        auto_upgrade(raw, at, kind)
    if "maxParallelUpgrades" in raw:
        whole(
            raw["maxParallelUpgrades"],
            at.child("maxParallelUpgrades"),
            hint="write a node count such as 1 (0 means no limit)",
        )
    if "maxUnavailable" in raw:
        max_unavailable(raw["maxUnavailable"], at.child("maxUnavailable"))
    for key, (cls, fields, if_nil) in _HELM_BLOCKS.items():
        if key in raw and if_nil is not None:
            _required_block(cls, raw, at.child(key), fields, if_nil=if_nil)
        elif key in raw:
            _block(cls, raw[key], at.child(key), fields)
    _driver_version(doc, kind, source)
    refuse_sandbox_workloads(doc, kind, source)
    given = {("podDeletion" if key == HELM_POD_DELETION else key): value for key, value in raw.items()}
    return flat_knobs(given)


def _driver_version(doc: Mapping[str, Any], kind: SourceKind, source: str) -> str | None:
    path = VERSION_PATHS[kind]
    value = dig(doc, path, source)
    if value is None:
        return None
    at = At(source, ".".join(path))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise at.error(
            f"is the number {value!r}, not a version string",
            hint='quote it, e.g. version: "580.95.05" (YAML reads 570.10 as 570.1)',
        )
    if not isinstance(value, str) or not value.strip():
        raise at.error(f"is {shown(value)}, not a version", hint='write e.g. version: "580.95.05"')
    return value.strip()
