"""The probe loop: `ProbeLoop` creates probe Jobs (`workloads.probe`) at a fixed cadence through the whole
change. Each tick creates one pool probe Job (pinned to the pool node: when can new work land there again?)
and one fleet probe Job (one GPU on any other node: does the fleet keep starting work?), which claims its GPU
through DRA where the run's GPU job does. Their latencies come from the recorder's pod stream, not from polling;
the Jobs finish by themselves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

from pytest_gpucanary.canary import claims
from pytest_gpucanary.canary.workloads import Placement, probe
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict
from pytest_gpucanary.ladder.index import TimelineIndex
from pytest_gpucanary.ladder.model import ProbeSeen


class ProbeLoop:
    def __init__(
        self,
        kube: Kube,
        placement: Placement,
        *,
        manifest: Path | None,
        interval_s: float,
        pool_nodes: tuple[str, ...],
        scopes: tuple[str, ...] = ("pool", "fleet"),
        images: Mapping[str, str] | None = None,
        first_seq: int = 0,
        claim_gpus: bool = False,
    ) -> None:
        self.images, self.first_seq = dict(images or {}), first_seq  # names go on from first_seq
        self.claim_gpus = claim_gpus  # a probe asking for GPUs claims them through DRA, as the run's GPU job does
        self._templates: set[int] = set()  # the GPU counts whose claim template the loop made
        self.kube, self.placement, self.manifest, self.pool_nodes = kube, placement, manifest, pool_nodes
        self.interval_s, self.scopes = interval_s, scopes
        self.created: dict[str, tuple[str, int]] = {}  # name -> (scope, created_wall_ns)
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
        seq = self.first_seq
        while not self._stop.is_set():
            for scope in self.scopes:
                job = probe(
                    self.manifest, self.placement, scope=scope, seq=seq, pool_nodes=self.pool_nodes, images=self.images
                )
                if self.claim_gpus:
                    job = self._claiming(job)
                created_wall_ns = time.time_ns()  # before the call, so no watch event can precede it
                try:
                    self.kube.create(job)
                    self.created[job["metadata"]["name"]] = (scope, created_wall_ns)
                except GpucanaryError as err:
                    self.errors.append(str(err))
            seq += 1
            self._stop.wait(self.interval_s)

    def _claiming(self, job: dict) -> dict:
        job, counts = claims.claiming(job)
        for count in sorted(counts - self._templates):
            try:
                self.kube.create(claims.template(count, self.placement.namespace, self.placement.run_id))
            except Conflict:
                pass  # the GPU job's, made before the loop started
            self._templates.add(count)
        return job

    def results(self, index: TimelineIndex) -> list[ProbeSeen]:
        return index.probes_seen(dict(self.created), namespace=self.placement.namespace)  # dict(): the loop adds
