"""The run's waits on the cluster after the policy is applied: the upgrade's watch (every pool node's end
state, a cause that will not clear by itself, a breach of the blast radius), with the logs and events it
reads to name what a rollout waits on, and the settle that lets the GPU job and the probes in flight finish.
Each wait is bounded: what has not happened by then is reported, not waited for.
"""

from __future__ import annotations

import functools
import time

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary.measures import Measured
from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.canary.probes import ProbeLoop
from pytest_gpucanary.canary.recorder import Recorder
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.ladder import WorkloadRef, diagnosis, stall, timeline
from pytest_gpucanary.ladder.cause import NOT_STARTED, OPERAND_BLOCKED, READY_DRIVER, SANDBOX_NOT_READY, Cause
from pytest_gpucanary.ladder.index import TimelineIndex
from pytest_gpucanary.progress import ProgressLine

# past the GPU job's deadline: a replacement pod evicted late in the upgrade is scheduled again after the
# uncordon and must start and finish its last round
JOB_COMPLETION_GRACE_S = 120
LOG_EVERY_S = 20  # how often the log of a container that has not started is read while it lasts
# what the kubelet answers (as the log itself) for a container it is replacing, as a crash loop's restart does;
# a moment later it has the log again
LOG_GONE = "unable to retrieve container logs for"
LOG_READS = 3


class RunWaits:
    """The waiting steps of `CanaryRun`, on its settings, cluster and progress line."""

    settings: Settings
    kube: Kube
    progress: ProgressLine

    def _watch_upgrade(self, pool: Pool, recorder: Recorder, release: str | None, run: Measured) -> list[str]:
        """Wait for every pool node's end state within the budget, a cause that will not clear by itself
        (kept in `run.stalled`), or a breach of the blast radius (returned)."""
        blast_radius = run.blast_radius
        started, started_wall_ns = time.monotonic(), time.time_ns()
        budget_s = self.settings.upgrade_budget_s
        said: set[tuple[str, str, bool]] = set()
        read_at: dict[tuple[str, str, str], int] = {}  # wall ns of each not-started container's last log read
        while time.monotonic() - started < budget_s:
            if blast_radius is not None and blast_radius.breaches:
                return list(blast_radius.breaches)
            try:
                recorder.wait_for(functools.partial(all_terminal, nodes=pool.nodes), timeout_s=2.0)
                break
            except TimeoutError:
                pass
            found = self._causes(pool, recorder, run, started_wall_ns)
            # a start still printing keeps its time; a sandbox that does not come gets the kubelet's words (both read)
            if self._read_quiet_logs(found, recorder, read_at) | self._read_warnings(found, recorder, read_at):
                found = self._causes(pool, recorder, run, started_wall_ns)
            for cause in found:
                # a change of cause, printed once; an operand's also when its wait starts to count (the driver Ready)
                key = (cause.what, cause.reason, cause.message.endswith(f"({READY_DRIVER})"))
                if key not in said:
                    said.add(key)
                    self.progress.line(f"rollout: {cause.line((cause.since_wall_ns - started_wall_ns) / 1e9)}")
            if stuck := stall.first_terminal(found):
                run.stalled = stuck
                if stuck.reason in ("CrashLoopBackOff", OPERAND_BLOCKED):  # its own words, quoted
                    self._read_log(stuck, recorder, previous=stuck.reason == "CrashLoopBackOff")
                if said_last := diagnosis.last_meaningful(diagnosis.log_tail(recorder.records, stuck)):
                    self.progress.line(f"rollout: {stuck.container} said last: {said_last}")
                self.progress.line(
                    f"rollout: {stuck.node}: that will not clear by itself; stopping the wait "
                    f"after {time.monotonic() - started:.0f} s of the {budget_s:.0f} s budget"
                )
                break
            waits_on = (
                (
                    f"{found[-1].what}: {found[-1].reason} since "  # rather than the last event again
                    f"+{(found[-1].since_wall_ns - started_wall_ns) / 1e9:.0f} s"
                )
                if found
                else None
            )
            self.progress.status(self._status_text(pool, recorder, time.monotonic() - started, release, waits_on))
        for node in pool.nodes:
            state = timeline.terminal_state(recorder.records, node) or "no end state within the budget"
            self.progress.line(f"{node}: {state} after {time.monotonic() - started:.0f} s")
        return list(blast_radius.breaches) if blast_radius is not None else []

    def _causes(self, pool: Pool, recorder: Recorder, run: Measured, started_wall_ns: int) -> list[Cause]:
        records = recorder.records
        return [
            c
            for n in pool.nodes
            for c in stall.causes(
                records,
                n,
                since_wall_ns=started_wall_ns,
                policy=run.upgrade_policy,
                now_wall_ns=time.time_ns(),
                stuck_s=self.settings.stall_s,
            )
        ]

    def _read_quiet_logs(
        self, found: list[Cause], recorder: Recorder, read_at: dict[tuple[str, str, str], int]
    ) -> bool:
        """Read the log of each container that has not started, every LOG_EVERY_S and once more when its
        time is up; True when one has changed since (a new record, so its quiet time starts again)."""
        changed = False
        for cause in (c for c in found if c.reason == NOT_STARTED):
            key, now = (cause.namespace, cause.pod, cause.container), time.time_ns()
            last = read_at.get(key)
            due = last is None or (
                last < cause.terminal_wall_ns if cause.terminal_wall_ns else now - last >= LOG_EVERY_S * 1e9
            )
            if due:
                read_at[key] = now
                changed |= self._read_log(cause, recorder, previous=False)
        return changed

    def _read_warnings(self, found: list[Cause], recorder: Recorder, read_at: dict[tuple[str, str, str], int]) -> bool:
        """The newest Warning event of each pod whose sandbox does not come (the kubelet's FailedMount or
        FailedCreatePodSandBox), read every LOG_EVERY_S while it lasts; True when one has changed."""
        changed = False
        for cause in (c for c in found if c.reason == SANDBOX_NOT_READY):
            key, now = (cause.namespace, cause.pod, ""), time.time_ns()
            if (last := read_at.get(key)) is not None and now - last < LOG_EVERY_S * 1e9:
                continue
            read_at[key] = now
            try:
                events = self.kube.list(
                    "v1",
                    "Event",
                    namespace=cause.namespace,
                    field_selector=f"involvedObject.kind=Pod,involvedObject.name={cause.pod}",
                )
            except GpucanaryError as err:
                self.progress.line(f"rollout: cannot read the events of {cause.pod}: {err}")
                continue
            warnings = sorted(
                (e for e in events if e.get("type") == "Warning"),  # what keeps the sandbox first
                key=lambda e: (
                    e.get("reason") in diagnosis.SANDBOX_WARNINGS,
                    e.get("lastTimestamp") or e.get("eventTime") or "",
                ),
            )
            if warnings:
                record = diagnosis.warning_record(
                    cause, warnings[-1], mono_ns=time.monotonic_ns(), wall_ns=time.time_ns()
                )
                if record.object["text"] != diagnosis.last_warning(recorder.records, cause):
                    recorder.note(record)
                    changed = True
        return changed

    def _read_log(self, cause: Cause, recorder: Recorder, *, previous: bool) -> bool:
        """A container's own words (a crash loop's last run: `previous`): its log tail, into the timeline when
        it differs from the last read (the rung quotes it). Best effort: a log that cannot be read leaves the
        cause as the kubelet put it. True when a record was added."""
        for read in range(LOG_READS):
            if read:
                time.sleep(2.0)
            try:
                text = self.kube.pod_log(
                    cause.pod,
                    namespace=cause.namespace,
                    container=cause.container,
                    previous=previous,
                    tail_lines=diagnosis.LOG_TAIL_LINES,
                )
            except GpucanaryError as err:
                self.progress.line(f"rollout: cannot read the log of {cause.pod}/{cause.container}: {err}")
                return False
            if not text.startswith(LOG_GONE):
                break
        else:
            self.progress.line(f"rollout: cannot read the log of {cause.pod}/{cause.container}: {text.strip()}")
            return False
        record = diagnosis.log_record(cause, text, mono_ns=time.monotonic_ns(), wall_ns=time.time_ns())
        if record.object["lines"] == diagnosis.log_tail(recorder.records, cause):
            return False
        recorder.note(record)
        return True

    def _status_text(
        self, pool: Pool, recorder: Recorder, elapsed_s: float, release: str | None, waits_on: str | None = None
    ) -> str:
        node = pool.nodes[0]
        states = timeline.upgrade_states(recorder.records, node)
        events = timeline.node_events(recorder.records, node)
        last = events[-1].message.replace("Successfully updated node state label to ", "state -> ") if events else "-"
        state = states[-1] if states else "?"
        if state == "pod-restart-required" and _waits_for_requeue(release):
            since = timeline.label_transitions(recorder.records, node, op.UPGRADE_STATE_LABEL)[-1].received_wall_ns
            if any(
                op.is_driver_pod(p.labels) and p.ready and p.first_seen_wall_ns > since
                for p in timeline.live_pods(recorder.records, node=node)
            ):
                last = "new driver pod Ready; this release moves on at its next 2-minute requeue"
        return f"{node}: {state} | {elapsed_s:.0f}/{self.settings.upgrade_budget_s:.0f} s | {waits_on or last}"

    def _settle(self, pool: Pool, recorder: Recorder, probes: ProbeLoop, run: Measured) -> None:
        """After the upgrade, give new work the chance to land again and the GPU job the time to complete
        (it works until its deadline, a replacement pod too), then let the probes in flight finish. All
        bounded: what has not happened by then is reported, not waited for."""
        wait_s = 2 * self.settings.probe_interval_s + 60
        job = run.gpu_job
        failed = [n for n in pool.nodes if timeline.terminal_state(recorder.records, n) == op.UPGRADE_FAILED]
        if run.stalled is not None or failed:  # the pool stays cordoned: nothing more will start or finish there
            why = "stalled" if run.stalled is not None else f"failed on {', '.join(failed)}"
            self.progress.line(f"the rollout {why}: not waiting for the GPU job or the probes in flight")
            probes.stop()
            return
        if all(timeline.terminal_state(recorder.records, n) == "upgrade-done" for n in pool.nodes):
            done_ns = time.time_ns()
            self._wait_quietly(
                recorder,
                lambda rs: (
                    True
                    if any(
                        p.scope == "pool" and p.created_wall_ns > done_ns and p.running_wall_ns
                        for p in probes.results(rs)
                    )
                    else None
                ),
                wait_s,
                "a pool probe running after the upgrade",
            )
            # a replacement evicted late is scheduled again after the uncordon and works its last round
            bound_s = max(0.0, (run.gpu_job_until_wall_ns - time.time_ns()) / 1e9) + JOB_COMPLETION_GRACE_S
        else:  # the pool is still cordoned: a replacement cannot start, only a running pod can finish
            bound_s = max(0.0, (run.gpu_job_until_wall_ns - time.time_ns()) / 1e9)
        self.progress.line(f"waiting for GPU job {job} to complete (at most {bound_s:.0f} s)")
        self._wait_quietly(recorder, functools.partial(_job_over, job=job), bound_s, f"GPU job {job} complete")
        probes.stop()
        # a probe whose pod was evicted before it ran (a Job of backoffLimit 0) is over, not in flight
        self._wait_quietly(
            recorder,
            lambda rs: True if all(p.running_wall_ns or p.ended_wall_ns for p in probes.results(rs)) else None,
            self.settings.max_start_latency_s + 10,
            "every probe in flight running or ended",
        )

    def _wait_quietly(self, recorder: Recorder, predicate, timeout_s: float, what: str) -> None:
        try:
            recorder.wait_for(predicate, timeout_s=timeout_s, what=what)
        except TimeoutError as err:
            self.progress.line(str(err))


def _waits_for_requeue(release: str | None) -> bool:
    """From v26.3 the node watch reacts only to upgrade-state and skip labels: nothing but the controller's
    2-minute requeue ends pod-restart-required once the new driver pod is Ready."""
    series = op.release_series(release) if release else None
    return series is not None and series >= (26, 3)


def all_terminal(index: TimelineIndex, nodes: tuple[str, ...]) -> bool | None:
    """Every node at an end state of its upgrade."""
    return True if all(index.terminal_state(n) for n in nodes) else None


def _job_over(index: TimelineIndex, job: WorkloadRef) -> bool | None:
    """The Job completed or failed for good, as the Job controller says."""
    seen = index.latest_job(namespace=job.namespace, name=job.name)
    return True if seen is not None and (seen.complete_wall_ns or seen.failed_reason) else None
