"""Sweep inputs: a YAML inventory file, or plain node/pod dicts already fetched from a cluster.

Pure: `fleet_from_cluster` receives dicts (as `kubectl get -o json` or the client's `to_dict()`
gives them, camelCase or snake_case keys) and never calls the API; the fetch belongs to `kube`.
Bad input is a ConfigError naming the file or object and the field.

Where node versions come from (first present wins):
  driver  annotation or label `gpucanary.io/driver-version`, else GFD's
          `nvidia.com/cuda.driver.major`.`minor`.`rev`
  cuda    annotation or label `gpucanary.io/cuda-version`, else GFD's
          `nvidia.com/cuda.runtime.major`.`minor`
  engine  annotation or label `gpucanary.io/engine-version`
  model   annotation or label `gpucanary.io/model-version`
GPU model from label `nvidia.com/gpu.product`; GPU count from capacity `nvidia.com/gpu` (time-sliced
or MIG nodes advertise their shares there), else the devices of its `gpu.nvidia.com` ResourceSlices (a
node that offers its GPUs through DRA only, given `slices`), else label `nvidia.com/gpu.count`. Nodes
without `nvidia.com/gpu.product` are not GPU nodes and are left out.

Pod annotations (all optional; a pod is in the fleet when it runs on a GPU node and requests
`nvidia.com/gpu` or holds a ResourceClaim with devices allocated by `gpu.nvidia.com`, given `claims`):
  gpucanary.io/checkpoint-versions   JSON object: the versions its newest checkpoint was taken
                                     against, keys among driver, cuda, engine, model (a key left out
                                     was not recorded) and optionally gpu_model; absent: no checkpoint
  gpucanary.io/restore-seconds       seconds to restore that checkpoint (default 60)
  gpucanary.io/cold-start-seconds    seconds to start from nothing to ready (default 1200)
  gpucanary.io/remaining-seconds     seconds of work left; absent: runs until stopped (serving)
The in-memory work since the last start is `now - status.startTime`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.gpu_operator import DRA_GPU_DRIVER, allocated_gpus, claim_names
from pytest_gpucanary.sweep.model import Change, Component, Fleet, Node, SweepLimits, VersionSet, Workload, parse_change

CHECKPOINT_VERSIONS_ANNOTATION = "gpucanary.io/checkpoint-versions"
RESTORE_SECONDS_ANNOTATION = "gpucanary.io/restore-seconds"
COLD_START_SECONDS_ANNOTATION = "gpucanary.io/cold-start-seconds"
REMAINING_SECONDS_ANNOTATION = "gpucanary.io/remaining-seconds"
NODE_VERSION_KEYS = {c: f"gpucanary.io/{c.value}-version" for c in Component}
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_RESTORE_S = 60.0  # order of the field note's 63 s restore of a 670 GiB checkpoint on 8x B200
DEFAULT_COLD_START_S = 1200.0  # order of its 20.3 min native start of the same workload


@dataclass(frozen=True, slots=True)
class Inventory:
    fleet: Fleet
    change: Change | None
    limits: SweepLimits


NODE_KEYS = {"name", "gpu_model", "gpus", "versions"}
WORKLOAD_KEYS = {"name", "node", "gpus", "checkpoint", "restore_s", "cold_start_s", "since_start_s", "remaining_s"}
TOP_KEYS = {"nodes", "workloads", "defaults", "change", "limits", "versions"}  # versions: YAML anchors only
LIMIT_KEYS = {"max_parallel", "max_unavailable", "hold_back_gpus"}


def load_inventory(path: str | Path) -> Inventory:
    """Read a YAML inventory (schema: fixtures/sweep/inventory.yaml)."""
    from pytest_gpucanary.user_files import read_text, yaml_documents

    docs = yaml_documents(read_text(Path(path), what="inventory"), source=f"inventory {str(path)!r}")
    if len(docs) != 1:
        raise ConfigError(
            f"inventory {str(path)!r} holds {len(docs)} YAML documents",
            hint="give one; the schema is in fixtures/sweep/inventory.yaml",
        )
    data = docs[0]
    return inventory_from_dict(data, source=str(path))


def inventory_from_dict(data: Any, *, source: str = "inventory") -> Inventory:
    top = _mapping(data, source, TOP_KEYS)
    defaults = _mapping(top.get("defaults") or {}, f"{source}: defaults", {"restore_s", "cold_start_s"})
    nodes = tuple(_node(item, f"{source}: nodes[{i}]") for i, item in enumerate(_list(top, "nodes", source)))
    workloads = tuple(
        _workload(item, f"{source}: workloads[{i}]", defaults) for i, item in enumerate(_list(top, "workloads", source))
    )
    change = _change(top["change"], f"{source}: change") if top.get("change") else None
    limits = _mapping(top.get("limits") or {}, f"{source}: limits", LIMIT_KEYS)
    return Inventory(
        fleet=Fleet(nodes, workloads),
        change=change,
        limits=SweepLimits(
            max_parallel=_int(limits, "max_parallel", f"{source}: limits", default=1),
            max_unavailable=str(limits.get("max_unavailable", "25%")),
            hold_back_gpus=_int(limits, "hold_back_gpus", f"{source}: limits", default=0),
        ),
    )


def _mapping(value: Any, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} is not a mapping", hint="see fixtures/sweep/inventory.yaml")
    unknown = sorted(set(map(str, value)) - allowed)
    if unknown:
        raise ConfigError(f"{where} has unknown key {unknown[0]!r}", hint=f"use {', '.join(sorted(allowed))}")
    return value


def _list(top: Mapping[str, Any], key: str, source: str) -> list[Any]:
    value = top.get(key) or []
    if not isinstance(value, list):
        raise ConfigError(f"{source}: {key} is not a list", hint="write one '- ' item per entry")
    return value


def _str(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value).strip() == "":
        if isinstance(value, float):
            raise ConfigError(f"{where}: {key} {value!r} must be quoted", hint="YAML reads 12.10 as the number 12.1")
        raise ConfigError(f"{where}: {key} is missing or not text", hint="e.g. quote it")
    return str(value).strip()


def _int(raw: Mapping[str, Any], key: str, where: str, *, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} {value!r} is not a whole number", hint="e.g. 8")
    return value


def _seconds(raw: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ConfigError(f"{where}: {key} {value!r} is not seconds >= 0", hint="e.g. 600")
    return float(value)


def _versions(raw: Any, where: str, *, extra: set[str] | frozenset[str] = frozenset()) -> VersionSet:
    versions = _mapping(raw, where, {c.value for c in Component} | extra)
    return VersionSet(
        **{c.value: _str(versions, c.value, where) for c in Component if versions.get(c.value) is not None}
    )


def _node(raw: Any, where: str) -> Node:
    node = _mapping(raw, where, NODE_KEYS)
    return Node(
        name=_str(node, "name", where),
        gpu_model=_str(node, "gpu_model", where),
        gpus=_int(node, "gpus", where),
        versions=_versions(node.get("versions") or {}, f"{where}: versions"),
    )


def _workload(raw: Any, where: str, defaults: Mapping[str, Any]) -> Workload:
    w = _mapping(raw, where, WORKLOAD_KEYS)
    checkpoint = w.get("checkpoint")
    return Workload(
        name=_str(w, "name", where),
        node=_str(w, "node", where),
        gpus=_int(w, "gpus", where),
        checkpoint=None if checkpoint is None else _versions(checkpoint, f"{where}: checkpoint"),
        restore_s=_seconds(w, "restore_s", where, _seconds(defaults, "restore_s", "defaults", DEFAULT_RESTORE_S)),
        cold_start_s=_seconds(
            w, "cold_start_s", where, _seconds(defaults, "cold_start_s", "defaults", DEFAULT_COLD_START_S)
        ),
        since_start_s=_seconds(w, "since_start_s", where, 0.0),
        remaining_s=None if w.get("remaining_s") is None else _seconds(w, "remaining_s", where, 0.0),
    )


def _change(raw: Any, where: str) -> Change:
    change = _mapping(raw, where, {c.value for c in Component} | {"node_upgrade_s"})
    target = _versions({k: v for k, v in change.items() if k != "node_upgrade_s"}, where)
    return Change(target=target, node_upgrade_s=_seconds(change, "node_upgrade_s", where, 900.0))


def fleet_from_cluster(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    *,
    now: datetime,
    claims: Iterable[Mapping[str, Any]] = (),
    slices: Iterable[Mapping[str, Any]] = (),
) -> Fleet:
    """A fleet from fetched Node and Pod dicts; `now` (timezone-aware) dates the pods' in-memory work. On a cluster
    that offers GPUs through DRA, its ResourceClaims count the GPUs a pod holds through them and its ResourceSlices
    the GPUs of a node that has no `nvidia.com/gpu` (camelCase keys, as the API gives them)."""
    offered: dict[str, int] = {}
    for raw in slices:
        spec = raw.get("spec") or {}
        if spec.get("driver") == DRA_GPU_DRIVER and spec.get("nodeName"):
            offered[spec["nodeName"]] = offered.get(spec["nodeName"], 0) + len(spec.get("devices") or [])
    held = {(_get(c, "metadata", "namespace"), _get(c, "metadata", "name")): allocated_gpus(dict(c)) for c in claims}
    fleet_nodes = [node for raw in nodes if (node := _cluster_node(raw, offered)) is not None]
    by_name = {n.name: n for n in fleet_nodes}
    workloads = [w for raw in pods if (w := _cluster_workload(raw, by_name, now, held)) is not None]
    return Fleet(tuple(fleet_nodes), tuple(workloads))


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in key)
        obj = obj.get(key, obj.get(snake))
    return obj


def _meta(obj: Mapping[str, Any], key: str) -> Mapping[str, str]:
    return _get(obj, "metadata", key) or {}


def _node_version(labels: Mapping[str, str], annotations: Mapping[str, str], component: Component) -> str | None:
    key = NODE_VERSION_KEYS[component]
    gfd = {
        Component.DRIVER: (
            "nvidia.com/cuda.driver.major",
            "nvidia.com/cuda.driver.minor",
            "nvidia.com/cuda.driver.rev",
        ),
        Component.CUDA: ("nvidia.com/cuda.runtime.major", "nvidia.com/cuda.runtime.minor"),
    }.get(component)
    gfd_parts = [labels.get(k) or "" for k in gfd or ()]
    gfd_value = ".".join(gfd_parts) if gfd_parts and all(gfd_parts) else None
    for value in (annotations.get(key), labels.get(key), gfd_value):
        if value:
            return str(value)
    return None


def _cluster_node(raw: Mapping[str, Any], offered: Mapping[str, int]) -> Node | None:
    labels, annotations = _meta(raw, "labels"), _meta(raw, "annotations")
    name = _get(raw, "metadata", "name")
    product = labels.get(GPU_PRODUCT_LABEL)
    if not product or not name:
        return None
    count = (
        (_get(raw, "status", "capacity") or {}).get(GPU_RESOURCE) or offered.get(name) or labels.get(GPU_COUNT_LABEL)
    )
    gpus = _whole(count, f"node {name!r}: {GPU_RESOURCE}")
    versions = VersionSet(**{c.value: _node_version(labels, annotations, c) for c in Component})
    return Node(name=name, gpu_model=product, gpus=gpus, versions=versions)


def _whole(value: Any, where: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(f"{where} {value!r} is not a whole number", hint="check the object") from None


def _cluster_workload(
    raw: Mapping[str, Any], nodes: Mapping[str, Node], now: datetime, held: Mapping[tuple[str, str], int]
) -> Workload | None:
    node = nodes.get(_get(raw, "spec", "nodeName") or "")
    if node is None or _get(raw, "status", "phase") in ("Succeeded", "Failed"):
        return None
    containers = _get(raw, "spec", "containers") or []
    gpus = sum(_whole((_get(c, "resources", "limits") or {}).get(GPU_RESOURCE, 0), "pod GPU limit") for c in containers)
    namespace = _get(raw, "metadata", "namespace") or "default"
    gpus += sum(held.get((namespace, claim), 0) for claim in claim_names(dict(raw)))
    if gpus < 1:
        return None
    name = f"{_get(raw, 'metadata', 'namespace') or 'default'}/{_get(raw, 'metadata', 'name')}"
    notes = _meta(raw, "annotations")
    seconds = {
        key: _annotation_seconds(notes, key, name)
        for key in (RESTORE_SECONDS_ANNOTATION, COLD_START_SECONDS_ANNOTATION, REMAINING_SECONDS_ANNOTATION)
    }
    started = _get(raw, "status", "startTime")
    since_start_s = max(0.0, (now - _timestamp(started, name)).total_seconds()) if started else 0.0
    return Workload(
        name=name,
        node=node.name,
        gpus=gpus,
        checkpoint=_checkpoint(notes, name, node.gpu_model),
        restore_s=_or(seconds[RESTORE_SECONDS_ANNOTATION], DEFAULT_RESTORE_S),
        cold_start_s=_or(seconds[COLD_START_SECONDS_ANNOTATION], DEFAULT_COLD_START_S),
        since_start_s=since_start_s,
        remaining_s=seconds[REMAINING_SECONDS_ANNOTATION],
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _annotation_seconds(notes: Mapping[str, str], key: str, pod: str) -> float | None:
    if key not in notes:
        return None
    try:
        value = float(notes[key])
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise ConfigError(f"pod {pod!r}: annotation {key} {notes[key]!r} is not seconds >= 0", hint="e.g. '63'")
    return value


def _timestamp(value: Any, pod: str) -> datetime:
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"pod {pod!r}: status.startTime {value!r} is not a timestamp", hint="RFC 3339") from None


def _checkpoint(notes: Mapping[str, str], pod: str, gpu_model: str) -> VersionSet | None:
    """The recorded versions, or None when there is none or it was taken on another GPU model."""
    if CHECKPOINT_VERSIONS_ANNOTATION not in notes:
        return None
    where = f"pod {pod!r}: annotation {CHECKPOINT_VERSIONS_ANNOTATION}"
    try:
        record = json.loads(notes[CHECKPOINT_VERSIONS_ANNOTATION])
    except json.JSONDecodeError:
        raise ConfigError(f"{where} is not JSON", hint='e.g. {"driver": "570.172.08", "model": "m@1"}') from None
    versions = _versions(record, where, extra={"gpu_model"})
    if record.get("gpu_model") not in (None, gpu_model):
        return None  # a checkpoint never restores on another GPU model
    return versions


def apply_overrides(
    inventory: Inventory,
    *,
    change: list[str] | None = None,
    max_parallel: str | int | None = None,
    max_unavailable: str | None = None,
    hold_back_gpus: str | int | None = None,
) -> Inventory:
    """The inventory with command-line values taking precedence; it must end up with a change."""
    upgrade_s = inventory.change.node_upgrade_s if inventory.change else 900.0
    planned = parse_change(change, node_upgrade_s=upgrade_s) if change else inventory.change
    if planned is None:
        raise ConfigError("no change to plan", hint="pass --change driver=580.95.05 or add 'change:' to the inventory")
    limits = inventory.limits
    limits = SweepLimits(
        max_parallel=limits.max_parallel if max_parallel is None else _option_int("--max-parallel", max_parallel),
        max_unavailable=limits.max_unavailable if max_unavailable is None else max_unavailable,
        hold_back_gpus=limits.hold_back_gpus
        if hold_back_gpus is None
        else _option_int("--hold-back-gpus", hold_back_gpus),
    )
    return Inventory(inventory.fleet, planned, limits)


def _option_int(option: str, value: str | int) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{option} {value!r} is not a whole number", hint=f"e.g. {option} 2") from None
