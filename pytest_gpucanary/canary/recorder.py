"""Flight recorder: append-only JSONL timeline (`ladder.timeline.Record` per line) of what the watches saw.

Each record is flushed as it arrives, so a crash loses at most the line being written, and filed in the
recorder's `TimelineIndex` (`ladder.index`), which the run's waits read: a wait woken by every record looks
up what it waits for instead of reading the timeline again. Consumes
`Kube.watch()` events (list, then watch with resume); never polls the API. A watch that fails is
recorded as a WATCH_ERROR and restarted after a short backoff, so a gap is visible, not silent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.gpu_operator import daemonset_node, gpus_requested, holds_driver
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.waits import WatchEvent
from pytest_gpucanary.ladder import slices
from pytest_gpucanary.ladder.index import TimelineIndex
from pytest_gpucanary.ladder.timeline import Record, load

__all__ = ["Record", "Recorder", "StreamSpec", "load", "trim"]

T = TypeVar("T")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
ClaimedGpus = Callable[[dict], int]  # a pod's GPUs held through DRA claims (`claims.ClaimedGpus`)


@dataclass(frozen=True)
class StreamSpec:
    name: str
    api_version: str
    kind: str
    namespace: str | None = None
    label_selector: str | None = None
    field_selector: str | None = None
    recorded_as: str = ""  # the kind its records carry, when readers of the API kind must not see them


def spec_writers(managed_fields: list[dict]) -> dict[str, str]:
    """Which field manager last wrote a node's spec.unschedulable and spec.taints (an atomic list: its last writer
    wrote every taint in it), from its managedFields: who cordoned or tainted it."""
    writers = {}
    for entry in managed_fields:
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        for field_name in ("unschedulable", "taints"):
            if f"f:{field_name}" in spec:
                writers[field_name] = entry.get("manager", "unknown")
    return writers


def trim(kind: str, obj: dict, *, claimed_gpus: int = 0) -> dict:
    """Keep what the ladder reads; managedFields and pod specs are most of an object's bytes. A pod's GPUs are
    those it requests and `claimed_gpus`, those its DRA claims hold."""
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "managedFields"}
    meta.get("annotations", {}).pop("kubectl.kubernetes.io/last-applied-configuration", None)
    trimmed = {**obj, "metadata": meta}
    if kind == "Pod":
        spec = obj.get("spec", {})
        trimmed["spec"] = {
            "nodeName": spec.get("nodeName"),
            "gpus": gpus_requested(spec.get("containers", [])) + claimed_gpus,
            "emptyDirs": [v["name"] for v in spec.get("volumes", []) or [] if "emptyDir" in v],
        }
        if claimed_gpus:
            trimmed["spec"]["claimedGpus"] = claimed_gpus
        # gets the GPUs without asking for one (a claim or a request): the driver cannot unload
        if not claimed_gpus and (why := holds_driver(spec)):
            trimmed["spec"]["holdsDriver"] = why
        if not spec.get("nodeName") and (node := daemonset_node(spec)):
            trimmed["spec"]["daemonSetNode"] = node
    if kind == slices.KIND:
        trimmed["spec"] = slices.trimmed_spec(obj.get("spec") or {})
    if kind == "Job":  # its completion is in status; the pod template is the manifest the run wrote
        spec = obj.get("spec", {})
        trimmed["spec"] = {k: spec.get(k) for k in ("completions", "parallelism", "backoffLimit")}
    if kind == "Node":
        trimmed["status"] = {k: v for k, v in obj.get("status", {}).items() if k not in ("images", "nodeInfo")}
        if writers := spec_writers(obj.get("metadata", {}).get("managedFields") or []):
            meta["specWriters"] = writers
    return trimmed


class Recorder:
    """Runs one watch thread per stream and appends every event to `path`."""

    def __init__(
        self, kube: Kube, path: Path, streams: list[StreamSpec], *, claimed_gpus: ClaimedGpus = lambda pod: 0
    ) -> None:
        self.kube = kube
        self.path = path
        self.streams = streams
        self.claimed_gpus = claimed_gpus
        self.index = TimelineIndex()
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._file: Any = None

    @property
    def records(self) -> list[Record]:
        return self.index.records

    def start(self) -> Recorder:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        for spec in self.streams:
            thread = threading.Thread(target=self._run, args=(spec,), name=f"recorder-{spec.name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, *, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout_s / max(1, len(self._threads)))
        if self._file:
            with self._changed:
                self._file.close()

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def note(self, record: Record) -> None:
        """Add what the run itself read (a crashing container's log) to the timeline, beside what was watched."""
        self._append(record)

    def _append(self, record: Record) -> None:
        with self._changed:
            if self._file.closed:  # a watch thread still ending after stop(); the run is over
                return
            self._file.write(record.to_json() + "\n")
            self.index.add(record)
            self._changed.notify_all()

    def _run(self, spec: StreamSpec) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                for event in self.kube.watch(
                    spec.api_version,
                    spec.kind,
                    stop=self._stop,
                    namespace=spec.namespace,
                    label_selector=spec.label_selector,
                    field_selector=spec.field_selector,
                ):
                    failures = 0
                    for record in _records(spec, event, self.claimed_gpus):
                        self._append(record)
            except GpucanaryError as err:
                self._append(
                    Record(
                        spec.name,
                        "WATCH_ERROR",
                        spec.recorded_as or spec.kind,
                        spec.namespace,
                        None,
                        time.monotonic_ns(),
                        time.time_ns(),
                        {"message": str(err)},
                    )
                )
                self._stop.wait(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1

    def wait_for(
        self, predicate: Callable[[TimelineIndex], T | None], *, timeout_s: float, what: str = "condition"
    ) -> T:
        """Block until `predicate(index)` returns something other than None; wakes on every record. The index
        is the records so far (a sequence of them) with the lookups a wait needs: a predicate that reads a
        lookup costs what the new record added, one that reads every record costs the whole timeline."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (result := predicate(self.index)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    raise TimeoutError(f"{what} not seen within {timeout_s:.0f} s")
                self._changed.wait(min(remaining, 5.0))
            return result


def _records(spec: StreamSpec, event: WatchEvent, claimed_gpus: ClaimedGpus) -> list[Record]:
    kind = spec.recorded_as or spec.kind

    def record(kind_type: str, obj: dict) -> Record:
        meta = obj.get("metadata", {})
        return Record(
            spec.name,
            kind_type,
            kind,
            meta.get("namespace"),
            meta.get("name"),
            event.received_mono_ns,
            event.received_wall_ns,
            trim(spec.kind, obj, claimed_gpus=claimed_gpus(obj) if spec.kind == "Pod" else 0),
        )

    if event.type == "RELISTED":
        items = event.object["items"]
        marker = Record(
            spec.name,
            "RELISTED",
            kind,
            spec.namespace,
            None,
            event.received_mono_ns,
            event.received_wall_ns,
            {"count": len(items)},
        )
        return [marker] + [record("LISTED", item) for item in items]
    return [record(event.type, event.object)]
