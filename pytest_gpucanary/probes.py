"""Customer start probes at a fixed cadence through the whole change.

Each tick creates one pool probe Job (pinned to the pool node: when can new work land there again?)
and one fleet probe Job (one GPU on any other node: does the fleet keep starting work?). Their
latencies come from the recorder's pod stream, not from polling; the Jobs finish by themselves.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary import workloads
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.recorder import Record


@dataclass(frozen=True)
class ProbeSeen:
    name: str
    scope: str                      # "pool" or "fleet"
    created_wall_ns: int            # client clock just before the create call
    scheduled_wall_ns: int | None   # first watch event with PodScheduled=True (client receive time)
    running_wall_ns: int | None     # first watch event with phase Running (client receive time)
    node: str | None


class ProbeLoop:
    def __init__(self, kube: Kube, placement: workloads.Placement, *, manifest: Path | None, interval_s: float,
                 pool_nodes: tuple[str, ...], scopes: tuple[str, ...] = ("pool", "fleet")) -> None:
        self.kube, self.placement, self.manifest, self.pool_nodes = kube, placement, manifest, pool_nodes
        self.interval_s, self.scopes = interval_s, scopes
        self.created: dict[str, tuple[str, int]] = {}   # name -> (scope, created_wall_ns)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpucanary-probes", daemon=True)

    def start(self) -> ProbeLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            for scope in self.scopes:
                job = workloads.probe(self.manifest, self.placement, scope=scope, seq=seq, pool_nodes=self.pool_nodes)
                created_wall_ns = time.time_ns()  # before the call, so no watch event can precede it
                try:
                    self.kube.create(job)
                    self.created[job["metadata"]["name"]] = (scope, created_wall_ns)
                except GpucanaryError as err:
                    self.errors.append(str(err))
            seq += 1
            self._stop.wait(self.interval_s)

    def results(self, records: list[Record]) -> list[ProbeSeen]:
        scheduled: dict[str, int] = {}
        running: dict[str, int] = {}
        nodes: dict[str, str] = {}
        for record in records:
            job = record.object.get("metadata", {}).get("labels", {}).get("job-name")
            if record.kind != "Pod" or record.namespace != self.placement.namespace or job not in self.created:
                continue
            status = record.object.get("status", {})
            if any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in status.get("conditions", [])):
                scheduled.setdefault(job, record.received_wall_ns)
            if status.get("phase") in ("Running", "Succeeded"):
                running.setdefault(job, record.received_wall_ns)
            if record.object.get("spec", {}).get("nodeName"):
                nodes[job] = record.object["spec"]["nodeName"]
        return [ProbeSeen(name, scope, created, scheduled.get(name), running.get(name), nodes.get(name))
                for name, (scope, created) in sorted(list(self.created.items()))]  # list(): the loop thread adds
