"""One run's evidence: the single frozen record a canary run builds, the ladder judges and the receipt draws.

It holds the recorded timeline plus what was measured beside it, raw: probes, every service request,
Prometheus' answers to the checks' queries; and who/what/when (ids, pool, versions, applied policy, CI
identity). Only the ladder judges: it cuts the requests by upgrade phase (here, when the evidence is made
or read) and judges the answers (ladder/metrics.py). The query helpers a gate test uses
(`queue_delays_s()`, ...) live here and delegate to the timeline queries. `to_json`/`from_json` carry
everything but the records and the requests, which live in timeline.jsonl and load.jsonl, so `gpucanary
evaluate` can judge a recorded run again from what the run wrote. The recorder goes on appending while the
run restores the cluster, so the evidence names how many timeline lines it holds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder import timeline
from pytest_gpucanary.ladder.index import TimelineIndex
from pytest_gpucanary.ladder.model import (
    CollectiveRun,
    MetricAnswer,
    MetricCheck,
    PhaseStats,
    ProbeScope,
    ProbeSeen,
    RatePoint,
    Sample,
    WorkloadRef,
)
from pytest_gpucanary.ladder.phases import rate_series, starts_of, stats_by_phase
from pytest_gpucanary.ladder.timeline import Record

if TYPE_CHECKING:
    pass

EVIDENCE_FILE = "evidence.json"
TIMELINE_FILE = "timeline.jsonl"
LOAD_FILE = "load.jsonl"  # one service request per line: [t_ns, latency_s, ok, status]
_APART = ("records", "load_samples")  # kept in their own files
SCHEMA = "gpucanary-evidence/1"


@dataclass(frozen=True)
class RunEvidence:
    records: tuple[Record, ...]
    pool_nodes: tuple[str, ...]
    driver_from: str
    driver_to: str
    upgrade_started_wall_ns: int
    gpu_job: WorkloadRef
    service: WorkloadRef  # a Deployment
    probes: tuple[ProbeSeen, ...] = ()
    metric_answers: tuple[MetricAnswer, ...] = ()  # what Prometheus answered to each shipped check, unjudged
    metric_checks: tuple[MetricCheck, ...] = ()  # judged at collection: only evidence recorded before answers were kept
    load_samples: tuple[Sample, ...] = ()  # every service request after the warm-up (load.jsonl beside the timeline)
    # the samples cut by the pool's first node's upgrade phases, and per second: derived from load_samples
    # when there are any (so a recorded run is cut again when judged again), else as recorded
    service_phases: tuple[PhaseStats, ...] = ()
    service_rate: tuple[RatePoint, ...] = ()
    upgrade_policy: Mapping[str, Any] = field(default_factory=dict, hash=False)  # the CR upgradePolicy applied
    run_id: str = ""
    policy_path: str = ""
    finished_wall_ns: int = 0
    ci: Mapping[str, str] = field(default_factory=dict, hash=False)
    gpu_job_work_s: float = 0.0  # the GPU work asked of the job (--gpucanary-job-duration-s); 0: not known
    gpu_job_until_wall_ns: int = 0  # its deadline (canary's wall clock, 1 s resolution); 0: not known
    # what the run changed beyond its pool, said out loud (ClusterPolicy mode: the cluster-wide version
    # and the nodes held back by the skip label); one line each
    exposure: tuple[str, ...] = ()
    held_nodes: tuple[str, ...] = ()  # GPU nodes the run held back with the operator's skip label
    operator_release: str = ""  # as the ClusterPolicy's Helm labels name it; "" when unknown
    policy_applied_to: str = ""  # which object got the policy and which the version
    # Helm values: the chart that rendered the applied CR, then each knob it filled in or changed; one line each
    policy_rendering: tuple[str, ...] = ()
    collective: tuple[CollectiveRun, ...] = ()  # the collective probe's baseline and after runs, in order
    collective_note: str = ""  # why no collective probe ran ("" when one did)
    # ClusterPolicy mode: each time the target reached beyond the pool (a GPU node not held back, a driver pod
    # outside the pool at the target), one line each; any fails rollout
    blast_radius: tuple[str, ...] = ()
    # how the pool was set up beyond its carve-out (its fence, a handover from the default NVIDIADriver): recorded,
    # not judged; one line each
    pool_setup: tuple[str, ...] = ()
    unproven: tuple[str, ...] = ()  # what the verdict does not speak for (pods holding DRA claims), one line each
    # the thresholds the run was judged with (Settings.thresholds()); `gpucanary evaluate` starts from them
    thresholds: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in _TUPLES:
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.load_samples and not self.service_phases:
            node = self.pool_nodes[0] if self.pool_nodes else ""
            since = self.upgrade_started_wall_ns
            starts = starts_of(self.index.phase_windows(node, since_wall_ns=since))
            object.__setattr__(self, "service_phases", stats_by_phase(self.load_samples, starts))
            object.__setattr__(self, "service_rate", tuple(rate_series(self.load_samples)))

    @functools.cached_property
    def index(self) -> TimelineIndex:
        """The timeline read once, for the stages' lookups."""
        return TimelineIndex(self.records)

    def offset_s(self, wall_ns: float) -> float:
        return (wall_ns - self.upgrade_started_wall_ns) / 1e9

    def end_wall_ns(self) -> int:
        span = self.index.span()
        return span[1] if span else self.upgrade_started_wall_ns

    def frozen_wall_ns(self) -> int:
        """The latest moment the evidence speaks for: when the run froze it, or its last record. A stall
        that had held its time by then is terminal, as the run saw it (the cluster may send nothing new)."""
        return max(self.finished_wall_ns, self.end_wall_ns())

    # --- what a gate test asks -------------------------------------------------------------------------

    def pods_gone(self) -> list[timeline.PodGone]:
        """Every pod removed from the pool nodes during the recording, in the order first seen."""
        return [gone for node in self.pool_nodes for gone in self.index.pods_gone(node)]

    def validator_results(self) -> list[timeline.PodSeen]:
        """The last state seen of each operator validator pod on the pool."""
        return timeline.validator_pods(self.records, self.pool_nodes)

    def queue_delays_s(self) -> list[float]:
        """Pool probes: created -> scheduled, client receive times (wall clock)."""
        return [
            (p.scheduled_wall_ns - p.created_wall_ns) / 1e9
            for p in self.probes
            if p.scope is ProbeScope.POOL and p.scheduled_wall_ns
        ]

    def start_latencies_s(self) -> list[float]:
        """Fleet probes: created -> Running, client receive times (wall clock)."""
        return [
            (p.running_wall_ns - p.created_wall_ns) / 1e9
            for p in self.probes
            if p.scope is ProbeScope.FLEET and p.running_wall_ns
        ]

    def upgrade_timeline(self) -> list[timeline.Transition]:
        return [t for node in self.pool_nodes for t in self.index.label_transitions(node, UPGRADE_STATE_LABEL)]

    # --- on disk ---------------------------------------------------------------------------------------

    def to_json(self) -> str:
        document = {
            "schema": SCHEMA,
            "timeline_records": len(self.records),
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _APART},
            "load_samples": len(self.load_samples),
        }
        return json.dumps(document, indent=1, default=_plain) + "\n"

    @classmethod
    def from_json(cls, text: str, records: tuple[Record, ...], samples: tuple[Sample, ...] = ()) -> RunEvidence:
        """The evidence of `text` over the timeline's first records (as many as it was judged on), with the load
        samples of load.jsonl (its phases cut again from them)."""
        doc = json.loads(text)
        if doc.pop("schema", None) != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document")
        if len(records) < doc["timeline_records"]:
            raise ValueError(f"the timeline holds {len(records)} records, the evidence {doc['timeline_records']}")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in _APART or f.name not in doc:
                continue  # a field newer than the document keeps its default; one without is a KeyError below
            raw, nested = doc[f.name], _NESTED.get(f.name)
            if nested is None:
                values[f.name] = raw
            else:
                values[f.name] = tuple(nested(**item) for item in raw) if isinstance(raw, list) else nested(**raw)
        if samples:  # cut again from the samples
            values.pop("service_phases", None)
            values.pop("service_rate", None)
        return cls(records=records[: doc["timeline_records"]], load_samples=samples, **values)

    def write(self, report_dir: Path) -> Path:
        """The evidence and its load samples beside its timeline (the recorder wrote timeline.jsonl as the run
        went)."""
        lines = (json.dumps([s.t_ns, s.latency_s, s.ok, s.status]) + "\n" for s in self.load_samples)
        (report_dir / LOAD_FILE).write_text("".join(lines), encoding="utf-8")
        path = report_dir / EVIDENCE_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @classmethod
    def read(cls, report_dir: Path) -> RunEvidence:
        text = (report_dir / EVIDENCE_FILE).read_text(encoding="utf-8")
        count = json.loads(text).get("timeline_records", 0)
        records = tuple(timeline.load(report_dir / TIMELINE_FILE)[:count])
        try:
            lines = (report_dir / LOAD_FILE).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []  # recorded before the samples were kept
        return cls.from_json(text, records, tuple(Sample(*json.loads(line)) for line in lines))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"cannot write {type(value).__name__} into the evidence")


# the fields that hold records of their own in evidence.json, and of which type
_NESTED: dict[str, Any] = {
    "gpu_job": WorkloadRef,
    "service": WorkloadRef,
    "probes": ProbeSeen,
    "metric_answers": MetricAnswer,
    "metric_checks": MetricCheck,
    "service_phases": PhaseStats,
    "service_rate": RatePoint,
    "collective": CollectiveRun,
}
# the fields kept as tuples whatever sequence they are given
_TUPLES = tuple(f.name for f in dataclasses.fields(RunEvidence) if str(f.type).startswith("tuple["))
