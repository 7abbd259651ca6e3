"""The records the run adds to the timeline while a cause lasts, and the reads of them: a container's log
tail (so the rung and a replay quote a crash loop's last words, and a container that has not started is
quiet only from its log's last change) and the newest Warning event of a pod whose sandbox does not come.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pytest_gpucanary.ladder.cause import Cause
from pytest_gpucanary.ladder.timeline import Record
from pytest_gpucanary.safe_text import one_line, without_secrets

LOG_KIND = "ContainerLog"  # a record the run adds: a container's log tail, when it has changed
# the kubelet's Warnings that say why a sandbox does not come (others, such as MissingClusterDNS, come with
# every pod on some nodes and say nothing of it)
SANDBOX_WARNINGS = ("FailedCreatePodSandBox", "FailedMount", "FailedAttachVolume", "NetworkNotReady")
WARNING_KIND = "PodWarning"  # a record the run adds: the newest Warning event of a pod whose sandbox does not come
LOG_TAIL_LINES = 20


def warning_record(cause: Cause, event: Mapping[str, Any], *, mono_ns: int, wall_ns: int) -> Record:
    """The record the run adds for the newest Warning event of a pod whose sandbox does not come."""
    text = without_secrets(one_line(f"{event.get('reason', '')}: {event.get('message', '')}"))[:300]
    return Record("diagnosis", "ADDED", WARNING_KIND, cause.namespace, cause.pod, mono_ns, wall_ns, {"text": text})


def last_warning(records: Iterable[Record], cause: Cause) -> str:
    """The Warning the run last read for the cause's pod, if it read one."""
    found = [r for r in records if r.kind == WARNING_KIND and r.namespace == cause.namespace and r.name == cause.pod]
    return found[-1].object.get("text", "") if found else ""


def log_record(cause: Cause, text: str, *, mono_ns: int, wall_ns: int) -> Record:
    """The record the run adds for a container's log (a crash loop's last run, or one that has not started),
    so the rung (and a replay) can quote it and see when it last changed."""
    lines = [without_secrets(one_line(line)) for line in text.splitlines() if line.strip()][-LOG_TAIL_LINES:]
    return Record(
        "diagnosis",
        "ADDED",
        LOG_KIND,
        cause.namespace,
        cause.pod,
        mono_ns,
        wall_ns,
        {"container": cause.container, "lines": lines},
    )


def log_tail(records: Iterable[Record], cause: Cause) -> list[str]:
    """The last log lines the run read for the cause's container, if it read them."""
    found = [
        r
        for r in records
        if r.kind == LOG_KIND
        and r.namespace == cause.namespace
        and r.name == cause.pod
        and r.object.get("container") == cause.container
    ]
    return list(found[-1].object.get("lines") or []) if found else []


# lines that only announce the next try (NVIDIA's validator: "Attempting to validate a driver container
# installation", "failed to validate the driver, retrying after 5 seconds"): what failed is said before them
_RETRY_WORDS = ("retrying after", "attempting to ")


def last_meaningful(lines: list[str]) -> str:
    """The last line that says something: not blank, not a shell's trace or a bare separator, and not a
    retry's announcement while a line before it says more."""
    said = [
        text
        for text in (" ".join(line.split()) for line in lines)
        if text and not text.startswith("+ ") and any(c.isalnum() for c in text)
    ]
    more = [text for text in said if not any(words in text.lower() for words in _RETRY_WORDS)]
    return (more or said or [""])[-1][:300]
