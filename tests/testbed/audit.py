"""The fleet apiserver's audit log as typed records: who asked what, when, as the server saw it.

Pure reading and filtering of the JSON lines the apiserver writes (policy: level Metadata, stage
RequestReceived omitted, request bodies of Node patches; see manifests.audit_policy). Never calls the
API. Timestamps are the
apiserver's clock at microsecond resolution; the fleet runs on this machine, so they compare with
the local wall clock (time.time()).

One request may log two events (a watch: ResponseStarted, then ResponseComplete when it ends);
`read_log` keeps one record per auditID, the latest stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from pytest_gpucanary.canary.lease import CLUSTER_LOCK_NAMESPACE
from pytest_gpucanary.canary.publish import NAMESPACE as VERDICT_NAMESPACE
from pytest_gpucanary.receipt.verdict import CONFIGMAP_PREFIX as VERDICT_PREFIX

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
LONG_RUNNING_VERBS = frozenset({"watch"})
# "created" but never stored: the apiserver answers the question and keeps nothing (the preflight's
# SelfSubjectAccessReviews), so they change no state and are not writes
REVIEW_RESOURCES = frozenset(
    {
        "selfsubjectaccessreviews",
        "selfsubjectrulesreviews",
        "subjectaccessreviews",
        "tokenreviews",
        "selfsubjectreviews",
    }
)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    audit_id: str
    stage: str  # ResponseStarted (a watch still open) or ResponseComplete
    verb: str  # get, list, watch, create, update, patch, delete, deletecollection
    user_agent: str
    request_uri: str
    api_group: str  # "" for the core group
    resource: str  # "" for non-resource URLs such as /api or /openapi/v3
    subresource: str
    namespace: str
    name: str
    code: int  # HTTP status; 0 while a watch is still open
    received_s: float  # requestReceivedTimestamp, Unix seconds (apiserver clock, 1 µs)
    stage_s: float  # stageTimestamp, same clock
    sets_phase: str = ""  # a pod status write: the status.phase its body sets ("" when none or not logged)
    request_object: object = None  # the request body, logged only for Node and pod status writes
    user: str = ""  # the authenticated user, e.g. system:serviceaccount:gpucanary:gpucanary
    authorization: str = ""  # RBAC's decision: allow, or forbid (a 403 with allow: an admission policy refused)

    @property
    def is_write(self) -> bool:
        return self.verb in WRITE_VERBS and self.resource not in REVIEW_RESOURCES

    @property
    def is_watch(self) -> bool:
        return self.verb in LONG_RUNNING_VERBS

    @property
    def kind_key(self) -> str:
        """`resource[/subresource]` qualified by its group: `nodes`, `pods/eviction`, `nvidiadrivers.nvidia.com`."""
        if not self.resource:
            return "(non-resource)"
        key = self.resource if not self.api_group else f"{self.resource}.{self.api_group}"
        return f"{key}/{self.subresource}" if self.subresource else key


def _unix_s(stamp: str) -> float:
    # "2026-11-30T12:34:56.123456Z"; fromisoformat reads the Z from Python 3.11 on
    return datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp() if stamp else 0.0


def _phase_set(body: object) -> str:
    # a JSON patch logs its body as a list of operations, not an object
    status = body.get("status") if isinstance(body, dict) else None
    return str(status.get("phase") or "") if isinstance(status, dict) else ""


def parse_event(event: dict) -> AuditRecord:
    ref = event.get("objectRef") or {}
    return AuditRecord(
        audit_id=event.get("auditID", ""),
        stage=event.get("stage", ""),
        verb=event.get("verb", ""),
        user_agent=event.get("userAgent", ""),
        request_uri=event.get("requestURI", ""),
        api_group=ref.get("apiGroup", ""),
        resource=ref.get("resource", ""),
        subresource=ref.get("subresource", ""),
        namespace=ref.get("namespace", ""),
        name=ref.get("name", ""),
        code=int((event.get("responseStatus") or {}).get("code") or 0),
        received_s=_unix_s(event.get("requestReceivedTimestamp", "")),
        stage_s=_unix_s(event.get("stageTimestamp", "")),
        request_object=event.get("requestObject"),
        sets_phase=_phase_set(event.get("requestObject")),
        user=str((event.get("user") or {}).get("username") or ""),
        authorization=str((event.get("annotations") or {}).get("authorization.k8s.io/decision") or ""),
    )


def log_files(path: Path) -> list[Path]:
    """The live log and its rotated siblings (audit-<time>.log), oldest first."""
    rotated = sorted(path.parent.glob(f"{path.stem}-*{path.suffix}"))
    return rotated + ([path] if path.exists() else [])


def _lines(paths: Iterable[Path]) -> Iterator[str]:
    for path in paths:
        with path.open(encoding="utf-8", errors="replace") as handle:
            yield from handle


def read_log(
    path: Path, *, user_agent_prefix: str | None = None, since_s: float | None = None, until_s: float | None = None
) -> list[AuditRecord]:
    """One record per request, in order of receipt, optionally only those matching the filters.

    `user_agent_prefix` also skips non-matching lines before decoding them, which keeps reading a
    1,000-node fleet's log (mostly kwok lease renewals) to seconds.
    """
    needle = f'"userAgent":"{user_agent_prefix}' if user_agent_prefix else None
    by_id: dict[str, AuditRecord] = {}
    for line in _lines(log_files(path)):
        if needle is not None and needle not in line:
            continue
        try:
            record = parse_event(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash mid-write
        by_id[record.audit_id] = record  # a later stage of the same request replaces the earlier one
    return sorted(
        select(by_id.values(), user_agent_prefix=user_agent_prefix, since_s=since_s, until_s=until_s),
        key=lambda r: r.received_s,
    )


def select(
    records: Iterable[AuditRecord],
    *,
    user_agent_prefix: str | None = None,
    since_s: float | None = None,
    until_s: float | None = None,
) -> list[AuditRecord]:
    """Records whose user agent starts with the prefix and that were received in [since_s, until_s]."""
    return [
        r
        for r in records
        if (user_agent_prefix is None or r.user_agent.startswith(user_agent_prefix))
        and (since_s is None or r.received_s >= since_s)
        and (until_s is None or r.received_s <= until_s)
    ]


POLICY_RESOURCES = frozenset({"clusterpolicies", "nvidiadrivers"})


class Scope(StrEnum):
    """Where one canary request went, relative to what that run owns; values are the report strings."""

    OWN_NAMESPACE = "own-namespace"  # gpucanary-<run-id>, its Lease's gpucanary-<run-id>-owner, their contents
    POOL_NODE = "pool-node"  # the nodes of its pool
    OWN_OBJECT = "own-object"  # a cluster-scoped object the run created itself (its NVIDIADriver)
    POLICY = "policy"  # ClusterPolicy / NVIDIADriver it patches and restores
    VERDICT = "verdict"  # a verdict ConfigMap in the canary's own namespace (publish.record)
    OTHER_NODE = "other-node"  # a node outside the pool (ClusterPolicy mode's skip labels)
    CLUSTER = "cluster"  # anything else (discovery, cluster-wide lists, foreign objects)


@dataclass(frozen=True)
class RunScope:
    """What one canary run owns: its namespace and pool, and the objects it created (from the log)."""

    run_id: str
    pool_nodes: frozenset[str]
    created: frozenset[tuple[str, str, str]] = frozenset()  # (resource.group, namespace, name)

    @property
    def namespace(self) -> str:
        return f"gpucanary-{self.run_id}"

    def with_creates(self, records: Iterable[AuditRecord]) -> RunScope:
        made = {
            (_base(r), r.namespace, r.name)
            for r in records
            if r.verb == "create" and not r.subresource and r.name and 200 <= r.code < 300
        }
        return RunScope(self.run_id, self.pool_nodes, frozenset(made) | self.created)

    @property
    def namespaces(self) -> frozenset[str]:
        """Its workload namespace, the one holding its Lease (lease.namespace_of) and, for a run that writes the
        ClusterPolicy, the lock that keeps other runs off it while it does."""
        return frozenset({self.namespace, f"{self.namespace}-owner", CLUSTER_LOCK_NAMESPACE})

    def scope_of(self, record: AuditRecord) -> str:
        if record.namespace in self.namespaces or (record.resource == "namespaces" and record.name in self.namespaces):
            return Scope.OWN_NAMESPACE
        if record.resource == "nodes" and record.api_group == "":
            if record.name in self.pool_nodes:
                return Scope.POOL_NODE
            if record.name:
                return Scope.OTHER_NODE
        if record.name and (_base(record), record.namespace, record.name) in self.created:
            return Scope.OWN_OBJECT
        if record.api_group == "nvidia.com" and record.resource in POLICY_RESOURCES and record.name:
            return Scope.POLICY
        if (
            record.resource == "configmaps"
            and record.api_group == ""
            and record.namespace == VERDICT_NAMESPACE
            and record.name.startswith(VERDICT_PREFIX)
        ):
            return Scope.VERDICT
        return Scope.CLUSTER


def _base(record: AuditRecord) -> str:
    return record.kind_key.split("/")[0]


def outside(records: Iterable[AuditRecord], scope: RunScope) -> list[AuditRecord]:
    """Writes that touched neither the run's namespace, pool nodes, own objects, the policy objects nor a verdict."""
    allowed = {Scope.OWN_NAMESPACE, Scope.POOL_NODE, Scope.OWN_OBJECT, Scope.POLICY, Scope.VERDICT}
    return [r for r in records if r.is_write and scope.scope_of(r) not in allowed]
