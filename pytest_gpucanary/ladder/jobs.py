"""The Jobs in the recorded timeline: when the watch first saw each probe Job's pod scheduled and running, a
Job's completion as the Job controller reports it, and the seconds its pods ran. Pure, like the timeline's
other queries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_gpucanary.ladder.model import ProbeScope, ProbeSeen
from pytest_gpucanary.ladder.timeline import SKIP_TYPES, Record, recording_span


def probes_seen(
    records: Iterable[Record], created: Mapping[str, tuple[str, int]], *, namespace: str
) -> list[ProbeSeen]:
    """Probe Jobs by name -> (scope, created wall ns): when the watch first saw each one's pod scheduled and running."""
    times: dict[str, dict[str, Any]] = {}
    for record in records:
        job = record.object.get("metadata", {}).get("labels", {}).get("job-name")
        if record.kind != "Pod" or record.namespace != namespace or job not in created:
            continue
        probe_step(times, job, record)
    return probes_of(times, created)


def probe_step(times: dict[str, dict[str, Any]], job: str, record: Record) -> None:
    """Fold one record of the Job's pods into its pod times (first scheduled, running, ended; its node)."""
    seen = times.setdefault(job, {})
    status = record.object.get("status", {})
    if any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in status.get("conditions", [])):
        seen.setdefault("scheduled", record.received_wall_ns)
    if status.get("phase") in ("Running", "Succeeded"):
        seen.setdefault("running", record.received_wall_ns)
    elif record.type == "DELETED" or status.get("phase") == "Failed":
        seen.setdefault("ended", record.received_wall_ns)
    if record.object.get("spec", {}).get("nodeName"):
        seen["node"] = record.object["spec"]["nodeName"]


def probes_of(times: Mapping[str, Mapping[str, Any]], created: Mapping[str, tuple[str, int]]) -> list[ProbeSeen]:
    """The created probe Jobs with their pod times, by name."""
    return [
        ProbeSeen(
            name,
            ProbeScope(scope),
            at,
            seen.get("scheduled"),
            seen.get("running"),
            seen.get("node"),
            None if "running" in seen else seen.get("ended"),
        )
        for name, (scope, at) in sorted(created.items())
        for seen in [times.get(name, {})]
    ]


@dataclass(frozen=True)
class JobSeen:
    """The last recorded state of one Job: its completion as the Job controller reports it."""

    namespace: str
    name: str
    succeeded: int  # pods that exited 0 (status.succeeded)
    failed: int  # pods that failed and counted against backoffLimit (status.failed)
    active: int
    complete_wall_ns: int | None  # first record with condition Complete=True, client receive time
    failed_reason: str  # reason of condition Failed=True (e.g. BackoffLimitExceeded); "" if none
    received_wall_ns: int


def latest_job(records: Iterable[Record], *, namespace: str, name: str) -> JobSeen | None:
    seen = None
    for record in records:
        if record.kind != "Job" or record.type in SKIP_TYPES or record.namespace != namespace or record.name != name:
            continue
        seen = job_seen(record, seen)
    return seen


def job_seen(record: Record, seen: JobSeen | None) -> JobSeen:
    """The Job as of this record of it, after `seen`."""
    status = record.object.get("status", {}) or {}
    conditions = {c.get("type"): c for c in status.get("conditions", []) or [] if c.get("status") == "True"}
    complete = (
        seen.complete_wall_ns
        if seen and seen.complete_wall_ns
        else (record.received_wall_ns if "Complete" in conditions else None)
    )
    return JobSeen(
        record.namespace or "",
        record.name or "",
        int(status.get("succeeded") or 0),
        int(status.get("failed") or 0),
        int(status.get("active") or 0),
        complete,
        conditions.get("Failed", {}).get("reason", "") or ("Failed" if "Failed" in conditions else ""),
        record.received_wall_ns,
    )


def run_seconds(records: Iterable[Record], *, namespace: str, job_name: str) -> float:
    """Seconds the Job's pods spent Running, summed over its pods (client receive times): from the
    first record of a pod Running to its first record ended or going away, else the recording's end."""
    records = list(records)
    span = recording_span(records)
    return seconds_run(records, span[1] if span else 0, namespace, job_name)


def seconds_run(records: Iterable[Record], end_ns: int, namespace: str, job_name: str) -> float:
    """`run_seconds`, the recording ending at `end_ns`."""
    started: dict[str, int] = {}
    ended: dict[str, int] = {}
    for record in records:
        meta = record.object.get("metadata", {})
        if (
            record.kind != "Pod"
            or record.type in SKIP_TYPES
            or record.namespace != namespace
            or (meta.get("labels") or {}).get("job-name") != job_name
        ):
            continue
        uid, phase = meta.get("uid", ""), (record.object.get("status") or {}).get("phase")
        if phase == "Running":
            started.setdefault(uid, record.received_wall_ns)
        if uid in started and (
            phase in ("Succeeded", "Failed") or record.type == "DELETED" or meta.get("deletionTimestamp")
        ):
            ended.setdefault(uid, record.received_wall_ns)
    return sum(max(0, ended.get(uid, end_ns) - start) for uid, start in started.items()) / 1e9
