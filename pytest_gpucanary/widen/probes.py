"""Customer start probes across the fleet while a wave rolls and soaks: the canary's fleet probe (a short Job
asking for one GPU on any node but a canary pool), one every --gpucanary-probe-interval-s, in a namespace of the
sweep's own, timed by the client's receive time of the pod watch (`PodWatch`) as a canary run times its own.

A wave fails when a probe it created waits longer than --gpucanary-max-queue-delay-s to be scheduled, or the p99
start latency of its probes (created to running; a probe not running yet counts with its age so far) passes
--gpucanary-max-start-latency-s; and at the end of its soak, when fewer than --gpucanary-min-probe-samples of its
probes ran: a wave no customer start was measured through is not a pass. A probe whose pod went before it ran (a
drain, a pod deletion) is not a start; the pod watch judges its removal like any other pod's."""

from __future__ import annotations

import time

from pytest_gpucanary.canary import workloads
from pytest_gpucanary.canary.probes import ProbeLoop
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import EnvError, GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict
from pytest_gpucanary.kube.ownership import owned_namespace
from pytest_gpucanary.ladder import jobs
from pytest_gpucanary.ladder.model import ProbeScope, ProbeSeen, summarize
from pytest_gpucanary.widen.watch import PodWatch

SERVICE_ACCOUNT_WAIT_S = 60


def judge(seen: list[ProbeSeen], now_wall_ns: int, settings: Settings, *, final: bool) -> tuple[str, str]:
    """(why the wave's probes fail it, or ""; what they showed, in one line)."""
    queue, start, started = [], [], 0
    for probe in seen:
        age_s = (now_wall_ns - probe.created_wall_ns) / 1e9
        if probe.running_wall_ns is not None:
            started += 1
            start.append(max(0.0, (probe.running_wall_ns - probe.created_wall_ns) / 1e9))
        elif probe.ended_wall_ns is None and age_s > settings.max_start_latency_s:
            start.append(age_s)  # not running yet: at least this late
        if probe.scheduled_wall_ns is not None:
            queue.append((max(0.0, (probe.scheduled_wall_ns - probe.created_wall_ns) / 1e9), probe))
        elif probe.ended_wall_ns is None:
            queue.append((max(0.0, age_s), probe))
    delay, late = max(queue, key=lambda pair: pair[0], default=(0.0, None))
    latency = summarize(start)
    summary = (
        f"{started} start probe{'' if started == 1 else 's'} ran: queue delay max {delay:.1f} s, start "
        f"latency p99 {latency.p99_s if latency else 0.0:.1f} s"
    )
    if late is not None and delay > settings.max_queue_delay_s:
        where = f"scheduled after {delay:.0f} s" if late.scheduled_wall_ns else f"unscheduled for {delay:.0f} s"
        return (
            f"start probe {late.name} {where}, over {flag('max_queue_delay_s')} {settings.max_queue_delay_s:g} s"
        ), summary
    if latency is not None and latency.p99_s > settings.max_start_latency_s:
        return (
            f"start probes' p99 start latency {latency.p99_s:.0f} s (n={latency.n}), over "
            f"{flag('max_start_latency_s')} {settings.max_start_latency_s:g} s"
        ), summary
    if final and started < settings.min_probe_samples:
        return (
            f"only {started} start probe{'' if started == 1 else 's'} ran during the wave, fewer than "
            f"{flag('min_probe_samples')} {settings.min_probe_samples}: no customer start was measured "
            "through it"
        ), summary
    return "", summary


class StartProbes:
    """The sweep's probe loop and namespace (gpucanary-<sweep run id>, the run's by label, so `gpucanary cleanup`
    finds it after a kill, and a resumed sweep goes on in it)."""

    def __init__(self, kube: Kube, settings: Settings, run_id: str, pods: PodWatch) -> None:
        self.kube, self.settings, self.pods = kube, settings, pods
        self.placement = workloads.Placement(f"gpucanary-{run_id}", run_id, "")
        self.loop: ProbeLoop | None = None

    def start(self) -> StartProbes:
        namespace = self.placement.namespace
        try:
            self.kube.create(owned_namespace(namespace, self.placement.run_id))
        except Conflict:
            pass  # a resumed sweep's: its probes go on after the killed one's
        try:
            self.kube.wait_for(
                "v1",
                "ServiceAccount",
                "default",
                lambda sa: True,
                namespace=namespace,
                timeout_s=SERVICE_ACCOUNT_WAIT_S,
            )
        except TimeoutError:
            raise EnvError(
                f"namespace {namespace} got no default ServiceAccount within {SERVICE_ACCOUNT_WAIT_S} s, "
                "so no start probe can run there",
                hint="kube-controller-manager's serviceaccount controller makes it: check that it runs",
            ) from None
        self.pods.watch_probes(namespace)
        self.loop = ProbeLoop(
            self.kube,
            self.placement,
            manifest=self.settings.probe,
            interval_s=self.settings.probe_interval_s,
            pool_nodes=(),
            scopes=(ProbeScope.FLEET.value,),
            images=self.settings.images(),
            first_seq=len(self.kube.list("batch/v1", "Job", namespace=namespace)),
        ).start()
        return self

    def look(self, since_wall_ns: int, *, final: bool = False) -> tuple[str, str]:
        """Judge the probes created since `since_wall_ns` (a wave's release), as `judge` does."""
        assert self.loop is not None, "started before it is looked at"
        created = {name: made for name, made in dict(self.loop.created).items() if made[1] >= since_wall_ns}
        seen = jobs.probes_seen(self.pods.probe_records(since_wall_ns), created, namespace=self.placement.namespace)
        failure, summary = judge(seen, time.time_ns(), self.settings, final=final)
        if final and not seen and self.loop.errors:  # what kept every probe of the wave from existing comes first
            failure = f"no start probe could be created: {self.loop.errors[-1]}"
        return failure, summary

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        try:
            self.kube.delete("v1", "Namespace", self.placement.namespace)
        except GpucanaryError:
            pass  # left for `gpucanary cleanup`, which finds it by its label
