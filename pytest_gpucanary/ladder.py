"""The launch ladder: rollout -> device -> network -> scheduler -> application, one verdict per stage.

Pure: takes a recorded timeline plus figures computed elsewhere (probe times, Prometheus checks, load
stats per upgrade phase) and returns verdicts. Never talks to a cluster, never imports pytest, kube
or kubernetes; the plugin and the CLI turn verdicts into failures and exit codes. Missing evidence
is inconclusive, never pass. Times are client receive times (wall clock, ns) unless stated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from pytest_gpucanary import timeline
from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.timeline import UpgradePhase

if TYPE_CHECKING:
    from pytest_gpucanary.recorder import Record

GPU_RESOURCE = "nvidia.com/gpu"
VALIDATOR_APP = "nvidia-operator-validator"
DRIVER_POD_LABELS = (("app.kubernetes.io/component", "nvidia-driver"), ("app", "nvidia-driver-daemonset"))


class Stage(str, Enum):
    ROLLOUT = "rollout"
    DEVICE = "device"
    NETWORK = "network"
    SCHEDULER = "scheduler"
    APPLICATION = "application"


class Outcome(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"


class ProbeScope(str, Enum):
    POOL = "pool"      # pinned to the canary pool: measures queue delay while it is cordoned
    FLEET = "fleet"    # anywhere: measures the customer's start latency


@dataclass(frozen=True)
class Evidence:
    received_wall_ns: int | None   # client receive time; None for figures computed elsewhere (metrics, load)
    offset_s: float | None         # seconds from upgrade start, same clock
    kind: str
    ref: str                       # namespace/name, or the name of a cluster-scoped object
    text: str


@dataclass(frozen=True)
class StageVerdict:
    stage: Stage
    outcome: Outcome
    summary: str                   # one line: stage, measured value, threshold
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True)
class WorkloadRef:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ProbeResult:
    name: str
    scope: ProbeScope
    created_wall_ns: int
    scheduled_wall_ns: int | None
    running_wall_ns: int | None
    node: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "scope", ProbeScope(self.scope))


@dataclass(frozen=True)
class MetricCheck:
    name: str
    stage: Stage
    outcome: Outcome               # Prometheus unreachable arrives as INCONCLUSIVE
    value: float | None
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", Stage(self.stage))
        object.__setattr__(self, "outcome", Outcome(self.outcome))


@dataclass(frozen=True)
class PhaseStats:
    phase: UpgradePhase
    requests: int
    failures: int
    p50_s: float | None            # load generator's clock
    p95_s: float | None
    p99_s: float | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", UpgradePhase(self.phase))


@dataclass(frozen=True)
class RunEvidence:
    records: tuple[Record, ...]
    pool_nodes: tuple[str, ...]
    driver_from: str
    driver_to: str
    upgrade_started_wall_ns: int
    gpu_job: WorkloadRef
    service: WorkloadRef           # a Deployment
    probes: tuple[ProbeResult, ...] = ()
    metric_checks: tuple[MetricCheck, ...] = ()
    service_phases: tuple[PhaseStats, ...] = ()
    service_rate: tuple[tuple[int, float, int, int], ...] = ()   # (bucket start wall ns, bucket s, requests, errors)
    upgrade_policy: Mapping[str, Any] = field(default_factory=dict, hash=False)  # the CR upgradePolicy applied

    def __post_init__(self) -> None:
        for name in ("records", "pool_nodes", "probes", "metric_checks", "service_phases"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def offset_s(self, wall_ns: int) -> float:
        return (wall_ns - self.upgrade_started_wall_ns) / 1e9

    def end_wall_ns(self) -> int:
        span = timeline.recording_span(self.records)
        return span[1] if span else self.upgrade_started_wall_ns


@dataclass(frozen=True)
class Thresholds:
    upgrade_budget_s: float = 1200.0    # validation alone may take 600 s (hard-coded in the operator)
    max_queue_delay_s: float = 300.0    # pool probes wait out the cordon: cordon to uncordon
    max_start_latency_s: float = 60.0
    min_probe_samples: int = 3
    allowed_evictions: str = "gpu"      # "gpu": pods requesting nvidia.com/gpu*; else a label selector
    max_error_ratio: float = 0.01       # 0..1, per upgrade phase
    max_p99_s: float = 1.0
    inconclusive_fails: bool = True

    def __post_init__(self) -> None:
        for name in ("upgrade_budget_s", "max_queue_delay_s", "max_start_latency_s", "max_p99_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"threshold {name} = {getattr(self, name)!r} must be > 0")
        if not 0 <= self.max_error_ratio <= 1:
            raise ConfigError(f"threshold max_error_ratio = {self.max_error_ratio!r} must be a fraction 0..1")
        if self.min_probe_samples < 1:
            raise ConfigError(f"threshold min_probe_samples = {self.min_probe_samples!r} must be >= 1")
        if self.allowed_evictions != "gpu":
            parse_selector(self.allowed_evictions)

    def allows_eviction(self, *, gpus: int, labels: Mapping[str, str]) -> bool:
        if self.allowed_evictions == "gpu":
            return gpus > 0
        return all(req(labels) for req in parse_selector(self.allowed_evictions))

    def allowed_text(self) -> str:
        return "GPU pods only" if self.allowed_evictions == "gpu" else f"pods matching {self.allowed_evictions}"


DEFAULT_THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class LadderResult:
    verdicts: tuple[StageVerdict, ...]
    first_failed: Stage | None
    gate_passed: bool
    thresholds: Thresholds = DEFAULT_THRESHOLDS

    def verdict(self, stage: Stage) -> StageVerdict:
        return next(v for v in self.verdicts if v.stage is stage)


# --- label selectors (the Kubernetes string form) ---------------------------------------------------

_REQUIREMENT = re.compile(r"""^\s*(?:
    (?P<not>!)\s*(?P<nkey>[\w./-]+) |
    (?P<skey>[\w./-]+)\s*(?P<sop>in|notin)\s*\((?P<values>[^()]*)\) |
    (?P<key>[\w./-]+)\s*(?P<op>==|!=|=)\s*(?P<value>[\w./-]*) |
    (?P<ekey>[\w./-]+)
    )\s*$""", re.X)


@lru_cache(maxsize=64)
def parse_selector(text: str) -> tuple[Callable[[Mapping[str, str]], bool], ...]:
    """`a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x,y)`, `a`, `!a`, joined by commas; all must hold."""
    parts = re.split(r",(?![^()]*\))", text)
    requirements = []
    for part in parts:
        m = _REQUIREMENT.match(part)
        if not part.strip() or not m:
            raise ConfigError(f"bad label selector {text!r} at {part.strip()!r}",
                              hint="use key=value, key!=value, key in (a,b), key notin (a,b), key or !key")
        requirements.append(_requirement(m))
    return tuple(requirements)


def _requirement(m: re.Match) -> Callable[[Mapping[str, str]], bool]:
    if m["nkey"]:
        return lambda labels, k=m["nkey"]: k not in labels
    if m["ekey"]:
        return lambda labels, k=m["ekey"]: k in labels
    if m["skey"]:
        values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
        if m["sop"] == "in":
            return lambda labels, k=m["skey"]: labels.get(k) in values
        return lambda labels, k=m["skey"]: labels.get(k) not in values   # absent key matches, as in Kubernetes
    if m["op"] == "!=":
        return lambda labels, k=m["key"], v=m["value"]: labels.get(k) != v
    return lambda labels, k=m["key"], v=m["value"]: labels.get(k) == v


# --- latency summaries -------------------------------------------------------------------------------

@dataclass(frozen=True)
class LatencySummary:
    n: int
    min_s: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float

    def describe(self, what: str, clock: str = "client receive time") -> str:
        return (f"{what} p50 = {self.p50_s:.1f} s, p95 = {self.p95_s:.1f} s, p99 = {self.p99_s:.1f} s, "
                f"max = {self.max_s:.1f} s (n={self.n}; {clock})")


def summarize(samples_s: Sequence[float]) -> LatencySummary | None:
    """Nearest-rank quantiles, so each is a real sample; None without samples."""
    ordered = sorted(samples_s)
    if not ordered:
        return None

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return LatencySummary(len(ordered), ordered[0], rank(0.50), rank(0.95), rank(0.99), ordered[-1])


# --- combining findings into a verdict ---------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    outcome: Outcome
    line: str                      # the summary without the "stage: " prefix


def _verdict(stage: Stage, findings: Iterable[Finding], evidence: Iterable[Evidence], pass_line: str) -> StageVerdict:
    findings = list(findings)
    for outcome in (Outcome.FAIL, Outcome.INCONCLUSIVE):
        bad = [f for f in findings if f.outcome is outcome]
        if bad:
            more = f" (+{len(bad) - 1} more {outcome.value})" if len(bad) > 1 else ""
            return StageVerdict(stage, outcome, f"{stage.value}: {bad[0].line}{more}", tuple(evidence))
    return StageVerdict(stage, Outcome.PASS, f"{stage.value}: {pass_line}", tuple(evidence))


def _metric_findings(ev: RunEvidence, stage: Stage) -> tuple[list[Finding], list[Evidence]]:
    findings, items = [], []
    for check in (c for c in ev.metric_checks if c.stage is stage):
        value = "no value" if check.value is None else f"{check.value:g}"
        line = f"metric {check.name} = {value} ({check.detail})"
        items.append(Evidence(None, None, "Metric", check.name, f"{check.outcome.value}: {line}"))
        if check.outcome is not Outcome.SKIPPED:
            findings.append(Finding(check.outcome, line))
    return findings, items


def _metrics_note(findings: list[Finding]) -> str:
    return f"; {len(findings)} metric check(s) passed" if findings else ""


def decide(verdicts: Sequence[StageVerdict], *, inconclusive_fails: bool = True,
           thresholds: Thresholds = DEFAULT_THRESHOLDS) -> LadderResult:
    """The gate: first_failed is the earliest stage (ladder order) whose outcome fails the gate."""
    failing = {Outcome.FAIL, Outcome.INCONCLUSIVE} if inconclusive_fails else {Outcome.FAIL}
    ordered = tuple(sorted(verdicts, key=lambda v: list(Stage).index(v.stage)))
    first = next((v.stage for v in ordered if v.outcome in failing), None)
    return LadderResult(ordered, first, first is None, thresholds)


# --- rollout -----------------------------------------------------------------------------------------

def _state_evidence(ev: RunEvidence, node: str, cycle: list[timeline.Transition]) -> list[Evidence]:
    items = [Evidence(t.received_wall_ns, ev.offset_s(t.received_wall_ns), "Node", node,
                      f"{timeline.UPGRADE_STATE_LABEL}={t.state or '(none)'}") for t in cycle]
    items += [Evidence(e.received_wall_ns, ev.offset_s(e.received_wall_ns), "Event", f"{e.namespace}/{node}",
                       f"{e.type} {e.reason}: {e.message}")
              for e in timeline.node_events(ev.records, node) if e.received_wall_ns >= ev.upgrade_started_wall_ns]
    return sorted(items, key=lambda i: i.received_wall_ns or 0)


def why_failed(ev: RunEvidence, node: str, cycle: list[timeline.Transition]) -> str:
    """The likely cause of an upgrade-failed, from the step that failed, the pods then on the node and the
    policy (the operator logs the cause but emits no event for it)."""
    if len(cycle) < 2:
        return ""
    step, failed = cycle[-2], cycle[-1]
    pods = [p for p in timeline.latest_pods(ev.records, until_wall_ns=failed.received_wall_ns)
            if p.node == node and p.removed_wall_ns is None and p.phase in ("Running", "Pending")
            and "DaemonSet" not in p.owner_kinds]
    knobs = {"pod-deletion-required": "podDeletion", "drain-required": "drain"}
    if step.state not in knobs:
        return f"failed in {step.state}"
    knob = knobs[step.state]
    spec = ev.upgrade_policy.get(knob, {})
    candidates = [p for p in pods if p.gpus > 0] if knob == "podDeletion" else pods
    for pod in candidates:
        if pod.empty_dirs and not spec.get("deleteEmptyDir", False):
            return (f"{knob} refused {'GPU ' if pod.gpus else ''}pod {pod.namespace}/{pod.name} with emptyDir "
                    f"{','.join(pod.empty_dirs)} ({knob}.deleteEmptyDir=false)")
        if not pod.owner_kinds and not spec.get("force", False):
            return f"{knob} refused unmanaged pod {pod.namespace}/{pod.name} ({knob}.force=false)"
    waited_s = (failed.received_wall_ns - step.received_wall_ns) / 1e9
    timeout_s = spec.get("timeoutSeconds")
    if timeout_s and waited_s >= timeout_s - 1:
        return (f"{knob} gave up after {waited_s:.0f} s ({knob}.timeoutSeconds={timeout_s}; "
                "a PodDisruptionBudget or a slow termination held the pods)")
    return f"{knob} failed after {waited_s:.0f} s"


def _rollout_node(ev: RunEvidence, node: str, th: Thresholds) -> tuple[Finding, float | None]:
    """One node's finding, and its time to upgrade-done (s from upgrade start) when it got there."""
    budget = f"budget {th.upgrade_budget_s:.0f} s"
    every = timeline.label_transitions(ev.records, node, timeline.UPGRADE_STATE_LABEL)
    if not every:
        return Finding(Outcome.INCONCLUSIVE, f"no Node records for pool node {node}"), None
    cycle = timeline.upgrade_cycle(ev.records, node, since_wall_ns=ev.upgrade_started_wall_ns)
    states = [t.state for t in cycle]
    if "upgrade-failed" in states:
        failed = cycle[states.index("upgrade-failed")]
        path = " -> ".join(states[:states.index("upgrade-failed") + 1])
        failed_s = ev.offset_s(failed.received_wall_ns)
        why = why_failed(ev, node, cycle[:states.index("upgrade-failed") + 1])
        return Finding(Outcome.FAIL, f"node {node} reached upgrade-failed at +{failed_s:.0f}s via {path}"
                                     f"{': ' + why if why else ''} (expected upgrade-done within {budget})"), None
    if "upgrade-done" in states:
        done_s = ev.offset_s(cycle[states.index("upgrade-done")].received_wall_ns)
        if done_s > th.upgrade_budget_s:
            return Finding(Outcome.FAIL, f"node {node} reached upgrade-done at +{done_s:.0f}s > {budget}"), done_s
        return Finding(Outcome.PASS, f"node {node} reached upgrade-done at +{done_s:.0f}s"), done_s
    current = states[-1] if states else (every[-1].state or "unlabelled")
    where = f"in {current}" if states else f"never entered upgrade-required (last state {current})"
    elapsed_s = ev.offset_s(ev.end_wall_ns())
    if elapsed_s >= th.upgrade_budget_s:
        return Finding(Outcome.FAIL, f"node {node} {where} at +{elapsed_s:.0f}s, no upgrade-done within {budget}"), None
    return Finding(Outcome.INCONCLUSIVE, f"node {node} {where} when the recording ended at +{elapsed_s:.0f}s "
                                         f"({budget} not yet spent)"), None


def check_rollout(evidence: RunEvidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> StageVerdict:
    """Every pool node reached upgrade-done after upgrade-required, within the budget from upgrade start."""
    if not evidence.pool_nodes:
        return _verdict(Stage.ROLLOUT, [Finding(Outcome.INCONCLUSIVE, "no pool nodes given")], [], "")
    findings, done_s, items = [], [], []
    for node in evidence.pool_nodes:
        finding, seconds = _rollout_node(evidence, node, thresholds)
        findings.append(finding)
        done_s += [seconds] if seconds is not None else []
        items += _state_evidence(evidence, node, timeline.upgrade_cycle(
            evidence.records, node, since_wall_ns=evidence.upgrade_started_wall_ns))
    metric_findings, metric_items = _metric_findings(evidence, Stage.ROLLOUT)
    n = len(evidence.pool_nodes)
    pass_line = (f"{n}/{n} pool nodes reached upgrade-done, slowest at +{max(done_s or [0]):.0f}s <= budget "
                 f"{thresholds.upgrade_budget_s:.0f} s (client receive time){_metrics_note(metric_findings)}")
    return _verdict(Stage.ROLLOUT, findings + metric_findings, items + metric_items, pass_line)


# --- device ------------------------------------------------------------------------------------------

def _live_on(ev: RunEvidence, node: str, labels: Iterable[tuple[str, str]]) -> list[timeline.PodSeen]:
    return [p for p in timeline.latest_pods(ev.records) if p.node == node and p.removed_wall_ns is None
            and any(p.labels.get(k) == v for k, v in labels)]


def _image_tag(image: str) -> str:
    name = image.split("@", 1)[0]
    return name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""


def _device_node(ev: RunEvidence, node: str) -> tuple[list[Finding], list[Evidence]]:
    cycle = timeline.upgrade_cycle(ev.records, node, since_wall_ns=ev.upgrade_started_wall_ns)
    done = next((t for t in cycle if t.state == "upgrade-done"), None)
    if done is None:
        return [Finding(Outcome.INCONCLUSIVE, f"node {node} never reached upgrade-done; device state not judged")], []
    findings, items = [], []
    for finding, pods in (_validator(ev, node), _driver(ev, node)):
        findings.append(finding)
        items += [Evidence(p.received_wall_ns, ev.offset_s(p.received_wall_ns), "Pod", f"{p.namespace}/{p.name}",
                           f"{p.phase}, {p.ready_containers}/{p.containers} containers ready, images "
                           f"{', '.join(p.images) or 'none reported'}") for p in pods]
    before = timeline.latest_node(ev.records, node, until_wall_ns=cycle[0].received_wall_ns)
    after = timeline.latest_node(ev.records, node)
    pre, post = (s.allocatable.get(GPU_RESOURCE) if s else None for s in (before, after))
    if pre is None:
        findings.append(Finding(Outcome.INCONCLUSIVE, f"node {node} had no {GPU_RESOURCE} allocatable recorded "
                                                      f"before the upgrade"))
    elif post != pre:
        findings.append(Finding(Outcome.FAIL, f"node {node} allocatable {GPU_RESOURCE} = {post} after upgrade-done, "
                                              f"expected {pre} (before the upgrade)"))
    if after is not None:
        items.append(Evidence(after.received_wall_ns, ev.offset_s(after.received_wall_ns), "Node", node,
                              f"allocatable {GPU_RESOURCE} = {post} (before the upgrade: {pre})"))
    return findings, items


def _validator(ev: RunEvidence, node: str) -> tuple[Finding, list[timeline.PodSeen]]:
    pods = _live_on(ev, node, [("app", VALIDATOR_APP)])
    if not pods:
        return Finding(Outcome.INCONCLUSIVE, f"no live app={VALIDATOR_APP} pod recorded on {node}"), []
    if any(p.phase == "Running" and p.ready for p in pods):
        return Finding(Outcome.PASS, "validator ready"), pods
    p = pods[-1]
    return Finding(Outcome.FAIL, f"validator pod {p.namespace}/{p.name} on {node} is {p.phase or 'unknown'} with "
                                 f"{p.ready_containers}/{p.containers} containers ready after upgrade-done "
                                 f"(expected Running, all ready)"), pods


def _driver(ev: RunEvidence, node: str) -> tuple[Finding, list[timeline.PodSeen]]:
    pods = _live_on(ev, node, DRIVER_POD_LABELS)
    if not pods:
        return Finding(Outcome.INCONCLUSIVE, f"no live driver pod recorded on {node} "
                                             f"(label app.kubernetes.io/component=nvidia-driver)"), []
    p = pods[-1]
    tags = [_image_tag(i) for i in p.images]
    if not tags:
        return Finding(Outcome.INCONCLUSIVE, f"driver pod {p.namespace}/{p.name} reports no container image"), pods
    if any(t.startswith(ev.driver_to) for t in tags):
        return Finding(Outcome.PASS, f"driver tag {tags[0]}"), pods
    return Finding(Outcome.FAIL, f"driver pod {p.namespace}/{p.name} on {node} runs tag {tags[0]}, expected a tag "
                                 f"starting {ev.driver_to}"), pods


def check_device(evidence: RunEvidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> StageVerdict:
    """After upgrade-done: validator ready, nvidia.com/gpu allocatable restored, driver image at the target."""
    findings, items = [], []
    for node in evidence.pool_nodes:
        node_findings, node_items = _device_node(evidence, node)
        findings += node_findings
        items += node_items
    if not evidence.pool_nodes:
        findings.append(Finding(Outcome.INCONCLUSIVE, "no pool nodes given"))
    metric_findings, metric_items = _metric_findings(evidence, Stage.DEVICE)
    n = len(evidence.pool_nodes)
    pass_line = (f"{n}/{n} pool nodes: validator Running and ready, {GPU_RESOURCE} allocatable restored, driver "
                 f"image tag starts with {evidence.driver_to}{_metrics_note(metric_findings)}")
    return _verdict(Stage.DEVICE, findings + metric_findings, items + metric_items, pass_line)


# --- network -----------------------------------------------------------------------------------------

ONE_NODE_REASON = "one-node pool: no multi-node collective probe possible"


def check_network(evidence: RunEvidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> StageVerdict:
    """A multi-node collective probe (reported as NETWORK metric checks); skipped, with the reason, on one node."""
    n = len(evidence.pool_nodes)
    if n == 1:
        return StageVerdict(Stage.NETWORK, Outcome.SKIPPED, f"{Stage.NETWORK.value}: {ONE_NODE_REASON}")
    findings, items = _metric_findings(evidence, Stage.NETWORK)
    if not findings:
        findings = [Finding(Outcome.INCONCLUSIVE, f"no multi-node collective probe result for the {n}-node pool (n=0)")]
    return _verdict(Stage.NETWORK, findings, items, f"{len(findings)} collective probe check(s) passed on {n} nodes")


# --- scheduler ---------------------------------------------------------------------------------------

def _probe_samples(ev: RunEvidence, scope: ProbeScope) -> tuple[list[float], list[Finding], list[Evidence]]:
    """Queue delay (pool: scheduled - created) or start latency (fleet: running - created), in s."""
    samples, findings, items = [], [], []
    what = "scheduled" if scope is ProbeScope.POOL else "running"
    for p in (p for p in ev.probes if p.scope is scope):
        end = p.scheduled_wall_ns if scope is ProbeScope.POOL else p.running_wall_ns
        created = f"created at +{ev.offset_s(p.created_wall_ns):.0f}s"
        if end is None:
            findings.append(Finding(Outcome.FAIL, f"{scope.value} probe {p.name} never {what} ({created}; recording "
                                                  f"ended at +{ev.offset_s(ev.end_wall_ns()):.0f}s)"))
            items.append(Evidence(p.created_wall_ns, ev.offset_s(p.created_wall_ns), "Probe", p.name,
                                  f"{scope.value} probe {created}, never {what}"))
            continue
        seconds = max(0.0, (end - p.created_wall_ns) / 1e9)   # one clock, but stay sane if it steps back
        samples.append(seconds)
        items.append(Evidence(end, ev.offset_s(end), "Probe", p.name,
                              f"{scope.value} probe {what} {seconds:.1f} s after creation on {p.node or 'no node'}"))
    return samples, findings, items


def _probe_finding(scope: ProbeScope, stats: LatencySummary | None, th: Thresholds) -> tuple[Finding, Evidence | None]:
    what = "queue delay" if scope is ProbeScope.POOL else "start latency"
    n = stats.n if stats else 0
    if stats is None or n < th.min_probe_samples:
        return Finding(Outcome.INCONCLUSIVE, f"{scope.value} probe {what} n={n} < min {th.min_probe_samples} "
                                             f"samples"), None
    if scope is ProbeScope.POOL:
        line = f"pool probe queue delay p100 = {stats.max_s:.1f} s (n={n}; client receive time)"
        value, limit = stats.max_s, th.max_queue_delay_s
    else:
        line = f"fleet probe start latency p99 = {stats.p99_s:.1f} s (n={n}; client receive time)"
        value, limit = stats.p99_s, th.max_start_latency_s
    record = Evidence(None, None, "ProbeStats", scope.value, stats.describe(f"{scope.value} probe {what}"))
    if value > limit:
        return Finding(Outcome.FAIL, f"{line} > {limit:.0f} s"), record
    return Finding(Outcome.PASS, f"{line} <= {limit:.0f} s"), record


def check_scheduler(evidence: RunEvidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> StageVerdict:
    """Pool probes' queue delay (max) and fleet probes' start latency (p99), every quantile with its n."""
    findings, items, passes = [], [], []
    for scope in ProbeScope:
        samples, never, probe_items = _probe_samples(evidence, scope)
        finding, stats_item = _probe_finding(scope, summarize(samples), thresholds)
        findings += never + [finding]
        items += probe_items + ([stats_item] if stats_item else [])
        passes.append(finding.line)
    metric_findings, metric_items = _metric_findings(evidence, Stage.SCHEDULER)
    pass_line = "; ".join(passes) + _metrics_note(metric_findings)
    return _verdict(Stage.SCHEDULER, findings + metric_findings, items + metric_items, pass_line)


# --- application -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Eviction:
    node: str
    namespace: str
    name: str
    gpus: int
    disruption_reason: str         # e.g. EvictionByEvictionAPI; "" when the pod was deleted without one
    by_drain: bool                 # the node passed through drain-required before the removal
    allowed: bool
    received_wall_ns: int

    def line(self, ev: RunEvidence, th: Thresholds) -> str:
        what = "GPU pod" if self.gpus else "non-GPU pod"
        verb = "evicted" if self.disruption_reason else "deleted"
        how = "by drain" if self.by_drain else "by pod deletion"
        return (f"{what} {self.namespace}/{self.name} {verb} {how} at +{ev.offset_s(self.received_wall_ns):.0f}s "
                f"(allowed: {th.allowed_text()})")


PROBE_LABEL = ("gpucanary.io/role", "probe")


def _is_probe(labels: Mapping[str, str]) -> bool:
    """The canary's own start probes are instruments: their latency is judged, not their eviction."""
    return labels.get(PROBE_LABEL[0]) == PROBE_LABEL[1]


def evictions(evidence: RunEvidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> list[Eviction]:
    """Non-DaemonSet pods removed from pool nodes between upgrade start and the node's terminal state.

    DaemonSet pods are left out: the operator restarts its own operands (driver, validators) by design,
    and neither pod deletion nor drain touches DaemonSet pods. So are the canary's probes."""
    pods = {(p.namespace, p.name): p for p in timeline.latest_pods(evidence.records)}
    found = []
    for node in evidence.pool_nodes:
        cycle = timeline.upgrade_cycle(evidence.records, node, since_wall_ns=evidence.upgrade_started_wall_ns)
        drain_ns = next((t.received_wall_ns for t in cycle if t.state == "drain-required"), None)
        end_ns = next((t.received_wall_ns for t in cycle if t.state in timeline.TERMINAL_STATES), None)
        for gone in timeline.pods_gone(evidence.records, node):
            seen = pods.get((gone.namespace, gone.name))
            if gone.received_wall_ns < evidence.upgrade_started_wall_ns or (
                    end_ns is not None and gone.received_wall_ns > end_ns):
                continue
            if seen is not None and ("DaemonSet" in seen.owner_kinds or _is_probe(seen.labels)):
                continue
            allowed = thresholds.allows_eviction(gpus=gone.gpus, labels=seen.labels if seen else {})
            found.append(Eviction(node, gone.namespace, gone.name, gone.gpus, gone.disruption_reason,
                                  drain_ns is not None and drain_ns <= gone.received_wall_ns, allowed,
                                  gone.received_wall_ns))
    return sorted(found, key=lambda e: e.received_wall_ns)


def _gpu_job(ev: RunEvidence) -> tuple[Finding, list[Evidence]]:
    job = ev.gpu_job
    pods = [p for p in timeline.latest_pods(ev.records) if p.namespace == job.namespace
            and p.labels.get("job-name") == job.name]
    items = [Evidence(p.received_wall_ns, ev.offset_s(p.received_wall_ns), "Pod", f"{p.namespace}/{p.name}",
                      f"GPU job pod {p.phase or 'unknown'}" + (" (removed)" if p.removed_wall_ns else ""))
             for p in pods]
    if not pods:
        return Finding(Outcome.INCONCLUSIVE, f"no pods of GPU job {job} recorded (label job-name={job.name})"), items
    if done := next((p for p in pods if p.phase == "Succeeded"), None):
        return Finding(Outcome.PASS, f"GPU job {job} succeeded (pod {done.name})"), items
    removed = [p.removed_wall_ns for p in pods if p.removed_wall_ns]
    replacement = next((p for p in pods if removed and p.phase == "Running" and p.removed_wall_ns is None
                        and p.first_seen_wall_ns >= min(removed)), None)
    if replacement is not None:
        return Finding(Outcome.PASS, f"GPU job {job} resumed (replacement pod {replacement.name} Running)"), items
    phases = ", ".join(f"{p.name} {p.phase or 'unknown'}" for p in pods)
    return Finding(Outcome.FAIL, f"GPU job {job} did not finish ({phases} at +{ev.offset_s(ev.end_wall_ns()):.0f}s; "
                                 f"expected Succeeded, or a replacement Running after eviction)"), items


def _service_phases(ev: RunEvidence, th: Thresholds) -> tuple[list[Finding], list[Evidence]]:
    findings, items = [], []
    by_phase = {s.phase: s for s in ev.service_phases}
    for phase in UpgradePhase:
        s = by_phase.get(phase)
        if s is None or s.requests == 0:
            findings.append(Finding(Outcome.INCONCLUSIVE, f"service {ev.service} has no requests in phase "
                                                          f"{phase.value} (n=0)"))
            continue
        ratio = s.failures / s.requests
        items.append(Evidence(None, None, "LoadStats", f"{ev.service}@{phase.value}",
                              f"{s.requests} requests, {s.failures} failed (ratio {ratio:.4f}), p50 = {s.p50_s} s, "
                              f"p95 = {s.p95_s} s, p99 = {s.p99_s} s (n={s.requests}; load generator clock)"))
        if ratio > th.max_error_ratio:
            findings.append(Finding(Outcome.FAIL, f"service {ev.service} error ratio {ratio:.3f} in phase "
                                                  f"{phase.value} ({s.failures}/{s.requests} requests) > "
                                                  f"{th.max_error_ratio:g}"))
        if s.p99_s is None:
            findings.append(Finding(Outcome.INCONCLUSIVE, f"service {ev.service} p99 missing in phase {phase.value}"))
        elif s.p99_s > th.max_p99_s:
            findings.append(Finding(Outcome.FAIL, f"service {ev.service} p99 = {s.p99_s:.3f} s in phase {phase.value} "
                                                  f"(n={s.requests}) > {th.max_p99_s:g} s"))
    return findings, items


def check_application(evidence: RunEvidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> StageVerdict:
    """No evictions beyond the allowed ones; the GPU job finished or resumed; the service kept its SLO per phase."""
    removed = evictions(evidence, thresholds)
    findings = [Finding(Outcome.FAIL, e.line(evidence, thresholds)) for e in removed if not e.allowed]
    items = [Evidence(e.received_wall_ns, evidence.offset_s(e.received_wall_ns), "Pod", f"{e.namespace}/{e.name}",
                      f"{e.line(evidence, thresholds)}; DisruptionTarget={e.disruption_reason or 'not seen'}; "
                      f"{'allowed' if e.allowed else 'NOT allowed'}") for e in removed]
    job_finding, job_items = _gpu_job(evidence)
    findings.append(job_finding)
    if evidence.service_phases:
        service_findings, service_items = _service_phases(evidence, thresholds)
        service_note = f"service {evidence.service} within SLO in all {len(UpgradePhase)} phases"
    else:
        service_findings, service_items = [], []
        service_note = f"service {evidence.service} judged on evictions only (no load stats)"
    metric_findings, metric_items = _metric_findings(evidence, Stage.APPLICATION)
    allowed = sum(e.allowed for e in removed)
    pass_line = (f"{allowed} allowed eviction(s), 0 others ({thresholds.allowed_text()}); {job_finding.line}; "
                 f"{service_note}{_metrics_note(metric_findings)}")
    return _verdict(Stage.APPLICATION, findings + service_findings + metric_findings,
                    items + job_items + service_items + metric_items, pass_line)


CHECKS: dict[Stage, Callable[[RunEvidence, Thresholds], StageVerdict]] = {
    Stage.ROLLOUT: check_rollout, Stage.DEVICE: check_device, Stage.NETWORK: check_network,
    Stage.SCHEDULER: check_scheduler, Stage.APPLICATION: check_application,
}


def evaluate(evidence: RunEvidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> LadderResult:
    """Every stage in ladder order, then the gate."""
    verdicts = [CHECKS[stage](evidence, thresholds) for stage in Stage]
    return decide(verdicts, inconclusive_fails=thresholds.inconclusive_fails, thresholds=thresholds)
