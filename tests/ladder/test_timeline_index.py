"""The timeline index gives the answers of the scans it replaces, on the canned runs and on any subset and
order of their records; the recorder's waits, reading it, see their condition on the same record as the
whole-timeline predicates they replace."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpucanary.canary import stage, waits
from pytest_gpucanary.canary.probes import ProbeLoop
from pytest_gpucanary.canary.recorder import Recorder
from pytest_gpucanary.gpu_operator import DRIVER_VERSION_LABEL, UPGRADE_STATE_LABEL
from pytest_gpucanary.ladder import WorkloadRef, jobs, stall, timeline
from pytest_gpucanary.ladder.diagnosis import LOG_KIND
from pytest_gpucanary.ladder.index import TimelineIndex
from pytest_gpucanary.ladder.timeline import Record

from canned_runs import NODE, T0, at, clean_run, field_note_run, pod, rdma_run  # canned runs, shared

CREATED = {"probe-pool-0": ("pool", at(1)), "probe-fleet-0": ("fleet", at(2)), "probe-late": ("pool", at(300))}


def extras() -> list[Record]:
    """What the canned runs lack: markers, a Job, probe pods, a pod without a node, a log the run read."""
    probe = {"job-name": "probe-pool-0", "gpucanary.io/role": "probe"}
    job = {"metadata": {"namespace": "default", "name": "train"},
           "status": {"active": 1, "conditions": [{"type": "Complete", "status": "True"}]}}
    return [
        Record("nodes", "RELISTED", "Node", None, None, at(40), at(40), {"count": 1}),
        Record("pods", "WATCH_ERROR", "Pod", None, None, at(41), at(41), {"message": "gone"}),
        Record("jobs", "MODIFIED", "Job", "default", "train", at(45), at(45), job),
        pod(3, "default", "probe-pool-0-x", labels=probe, node_name=None, phase="Pending", kind_type="ADDED"),
        pod(4, "default", "probe-pool-0-x", labels=probe, phase="Running"),
        pod(9, "default", "probe-pool-0-x", labels=probe, phase="Succeeded", ready=False),
        Record("diagnosis", "ADDED", LOG_KIND, "gpu-operator", f"driver-{NODE}-new", at(70), at(70),
               {"container": "main", "lines": ["loading"]}),
    ]


def timelines() -> list[list[Record]]:
    return [list(run.records) + extras() for run in (clean_run(), field_note_run(), rdma_run())]


def assert_same(records: list[Record]) -> None:
    index = TimelineIndex(records)
    since = T0
    assert index.span() == timeline.recording_span(records)
    assert list(index) == records and len(index) == len(records)
    assert index.latest_pods() == timeline.latest_pods(records)
    for label in ("", "default", "gpu-operator"):
        assert index.pods_in(label) == [p for p in timeline.latest_pods(records) if p.namespace == label]
        assert index.live_pods(namespace=label, label=("app", "sched-api")) == timeline.live_pods(
            records, namespace=label, label=("app", "sched-api"))
    for name in (NODE, "other"):
        for label in (UPGRADE_STATE_LABEL, DRIVER_VERSION_LABEL):
            assert index.label_transitions(name, label) == timeline.label_transitions(records, name, label)
        assert index.terminal_state(name) == timeline.terminal_state(records, name)
        assert index.upgrade_cycle(name, since_wall_ns=since) == timeline.upgrade_cycle(records, name, since_wall_ns=since)
        assert index.phase_windows(name, since_wall_ns=since) == timeline.phase_windows(records, name, since_wall_ns=since)
        assert index.state_spans(name) == timeline.state_spans(records, name)
        assert index.node_events(name) == timeline.node_events(records, name)
        assert index.allocatable_series(name, "nvidia.com/gpu") == timeline.allocatable_series(
            records, name, "nvidia.com/gpu")
        assert index.pods_gone(name) == timeline.pods_gone(records, name)
        assert index.pods_on(name) == [p for p in timeline.latest_pods(records) if p.node == name]
        assert index.live_pods(node=name) == timeline.live_pods(records, node=name)
        for until in (None, at(20), at(100)):
            assert index.latest_node(name, until_wall_ns=until) == timeline.latest_node(records, name, until_wall_ns=until)
            ever = [p for p in index.latest_pods(until_wall_ns=until, ever_on=name) if p.node == name]
            assert ever == [p for p in timeline.latest_pods(records, until_wall_ns=until) if p.node == name]
        assert stall.causes(index.stall_records(name), name, since_wall_ns=since, now_wall_ns=at(900)) == stall.causes(
            records, name, since_wall_ns=since, now_wall_ns=at(900))
    assert index.of_kind(LOG_KIND) == [r for r in records if r.kind == LOG_KIND]
    assert index.latest_job(namespace="default", name="train") == jobs.latest_job(
        records, namespace="default", name="train")
    assert index.run_seconds(namespace="default", job_name="train") == jobs.run_seconds(
        records, namespace="default", job_name="train")
    assert index.probes_seen(CREATED, namespace="default") == jobs.probes_seen(records, CREATED, namespace="default")


def test_the_index_answers_as_the_scans_on_the_canned_runs() -> None:
    for records in timelines():
        assert_same(records)
        assert_same(sorted(records, key=lambda r: r.received_wall_ns))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(3)), st.data())
def test_the_index_answers_as_the_scans_on_any_subset_in_any_order(which: int, data: st.DataObject) -> None:
    records = timelines()[which]
    picked = data.draw(st.lists(st.sampled_from(records), max_size=len(records)))
    assert_same(picked)


def old_waits(job: WorkloadRef) -> list[tuple[object, object]]:
    """(the wait as the run passes it now, the whole-timeline predicate it replaces)"""
    probes = SimpleNamespace(created=CREATED, placement=SimpleNamespace(namespace="default"))

    def job_over(rs: list[Record]) -> bool | None:
        seen = jobs.latest_job(rs, namespace=job.namespace, name=job.name)
        return True if seen is not None and (seen.complete_wall_ns or seen.failed_reason) else None

    def running(rs: list[Record]) -> bool | None:
        pods = timeline.live_pods(rs, namespace="default", label=("app", "gpu-job"))
        return True if any(p.phase == "Running" for p in pods) else None

    return [
        (functools.partial(waits.all_terminal, nodes=(NODE,)),
         lambda rs: True if all(timeline.terminal_state(rs, n) for n in (NODE,)) else None),
        (functools.partial(waits._job_over, job=job), job_over),
        (lambda ix: [p.running_wall_ns for p in ProbeLoop.results(probes, ix)],
         lambda rs: [p.running_wall_ns for p in jobs.probes_seen(rs, CREATED, namespace="default")]),
        (functools.partial(stage._running, namespace="default", role="gpu-job"), running),
    ]


def test_a_wait_reading_the_recorders_index_sees_its_condition_on_the_same_record(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(stage.workloads, "ROLE_LABEL", "app")  # the canned GPU job is labelled app=gpu-job
    for n, records in enumerate(timelines()):
        recorder = Recorder(SimpleNamespace(), tmp_path / f"timeline-{n}.jsonl", []).start()
        pairs = old_waits(WorkloadRef("default", "train"))
        try:
            for i, record in enumerate(sorted(records, key=lambda r: r.received_wall_ns)):
                recorder._append(record)
                for now, before in pairs:
                    assert now(recorder.index) == before(recorder.records[: i + 1]), (n, i, now)
            assert recorder.wait_for(pairs[0][0], timeout_s=1) is True
        finally:
            recorder.stop()
