"""A live run says so: a coordination.k8s.io Lease, renewed while the run lives; and fencing on it.

The run's first write is a namespace of its own holding only this Lease (the workload namespace goes
away before the policy is restored; this one is deleted last), so every change the run makes has a
live owner on the cluster.

Liveness is judged the leader-election way, never by comparing clocks of two hosts: an observer
reads the Lease's resourceVersion, waits one lease duration on its own monotonic clock, and reads it
again; a run is dead only when the version did not move (`observe`). Whoever acts on a dead run
first takes its Lease over with a compare-and-swap on that version (`take_over`): a second cleanup,
or the run itself renewing late, loses the swap and leaves it alone. The run renews with the same
swap; when it loses its Lease, or cannot renew it within a whole duration, it stops (its main
thread is interrupted, so it unwinds and restores with conditional writes only).
"""

from __future__ import annotations

import _thread
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict, NotFound
from pytest_gpucanary.kube.ownership import RUN_ID_LABEL, owned_labels, owned_namespace

LEASE = ("coordination.k8s.io/v1", "Lease")
LEASE_NAME = "gpucanary-run"
DURATION_S = 60  # a run that has not renewed for this long is gone


class Clock(Protocol):
    """The renewal's time: this host's monotonic clock, and a wait that a stop ends early."""

    def monotonic(self) -> float: ...

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        """Wait `seconds`, or until `stop` is set: True when it was."""
        ...


class _SystemClock:
    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def wait(stop: threading.Event, seconds: float) -> bool:
        return stop.wait(seconds)


SYSTEM_CLOCK = _SystemClock()


def namespace_of(run_id: str) -> str:
    return f"gpucanary-{run_id}-owner"


def _micro_time() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def identity() -> str:
    return f"{socket.gethostname()}/{os.getpid()}"


@dataclass(frozen=True)
class LeaseSeen:
    run_id: str
    holder: str
    resource_version: str
    duration_s: int


def read(kube: Kube, run_id: str) -> LeaseSeen | None:
    try:
        obj = kube.get(*LEASE, LEASE_NAME, namespace=namespace_of(run_id))
    except NotFound:
        return None
    spec = obj.get("spec") or {}
    try:
        duration_s = int(spec.get("leaseDurationSeconds", DURATION_S))
    except (TypeError, ValueError):
        duration_s = DURATION_S
    return LeaseSeen(
        run_id,
        str(spec.get("holderIdentity", "?")),
        obj["metadata"].get("resourceVersion", ""),
        max(1, min(duration_s, 3600)),
    )


def observe(
    kube: Kube, run_ids: set[str], *, sleep: Callable[[float], None] = time.sleep, report: Callable[[str], None] = print
) -> tuple[dict[str, LeaseSeen | None], dict[str, LeaseSeen]]:
    """(dead runs with their Lease as last seen, None where they have none; live runs). One Lease duration
    is waited out on this host's monotonic clock, once for all runs, and only when some run has a Lease."""
    first = {run: read(kube, run) for run in sorted(run_ids)}
    leased = {run: seen for run, seen in first.items() if seen is not None}
    if leased:
        wait_s = max(seen.duration_s for seen in leased.values())
        report(f"watching the Lease of {', '.join(leased)} for {wait_s} s: a run is gone only if it stops renewing")
        sleep(wait_s)
    dead: dict[str, LeaseSeen | None] = {run: None for run, seen in first.items() if seen is None}
    live: dict[str, LeaseSeen] = {}
    for run, seen in leased.items():
        now = read(kube, run)
        if now is None:
            continue  # released meanwhile: the run finished and restored what it changed
        if now.resource_version == seen.resource_version:
            dead[run] = now
        else:
            live[run] = now
    return dead, live


def take_over(kube: Kube, run_id: str, seen: LeaseSeen | None, holder: str) -> bool:
    """Make `holder` the owner of a run judged dead, by compare-and-swap on the Lease as it was seen (or, for
    a run that has none, by creating one). False when someone else got there first: leave the run alone."""
    try:
        if seen is not None:
            kube.patch(
                *LEASE,
                LEASE_NAME,
                {"spec": {"holderIdentity": holder, "renewTime": _micro_time()}},
                namespace=namespace_of(run_id),
                resource_version=seen.resource_version,
            )
            return True
        _create_lease(kube, run_id, holder, DURATION_S)
        return True
    except (Conflict, NotFound):
        return False


def _create_lease(kube: Kube, run_id: str, holder: str, duration_s: int) -> dict:
    try:
        kube.create(owned_namespace(namespace_of(run_id), run_id))
    except Conflict:
        pass  # a run killed right after its first write left the namespace without its Lease
    now = _micro_time()
    return kube.create(
        {
            "apiVersion": LEASE[0],
            "kind": LEASE[1],
            "metadata": {"name": LEASE_NAME, "namespace": namespace_of(run_id), "labels": owned_labels(run_id)},
            "spec": {
                "holderIdentity": holder,
                "leaseDurationSeconds": duration_s,
                "acquireTime": now,
                "renewTime": now,
            },
        }
    )


# Runs that write a cluster-wide object (the ClusterPolicy; its upgradePolicy before operator v26.7) exclude each
# other through one cluster-scoped object created with create-or-fail: a namespace of this name, labelled with
# the run that holds it (a Namespace is the one cluster-scoped kind the canary already creates).
CLUSTER_LOCK_NAMESPACE = "gpucanary-cluster-policy-lock"


def take_cluster_lock(kube: Kube, run_id: str) -> None:
    """Exit 6 (EnvError) naming the holder when another run holds the lock. A lock on its way out (a namespace
    terminating) is waited for, up to a minute."""
    lock = owned_namespace(CLUSTER_LOCK_NAMESPACE, run_id)
    holder = "?"
    for attempt in range(2):
        try:
            kube.create(lock)
            return
        except Conflict:
            try:
                found = kube.get("v1", "Namespace", CLUSTER_LOCK_NAMESPACE)["metadata"]
            except NotFound:
                continue  # released just now
            holder = (found.get("labels") or {}).get(RUN_ID_LABEL, "?")
            if not found.get("deletionTimestamp"):
                break
            if attempt == 0:
                kube.wait_gone("v1", "Namespace", CLUSTER_LOCK_NAMESPACE, timeout_s=60)
    raise EnvError(
        f"run {holder} holds the ClusterPolicy (namespace {CLUSTER_LOCK_NAMESPACE}): two runs that "
        "write it cannot overlap",
        hint=f"wait for it, or run `gpucanary cleanup --run-id {holder}` if it was killed",
    )


def release_cluster_lock(kube: Kube, run_id: str) -> None:
    """Delete the lock if `run_id` holds it: that very object, not one another run took since (uid precondition)."""
    try:
        meta = kube.get("v1", "Namespace", CLUSTER_LOCK_NAMESPACE)["metadata"]
        if (meta.get("labels") or {}).get(RUN_ID_LABEL) == run_id:
            kube.delete("v1", "Namespace", CLUSTER_LOCK_NAMESPACE, uid=meta["uid"])
    except (NotFound, Conflict):
        pass


def release(kube: Kube, run_id: str) -> None:
    """Delete the run's Lease with its namespace: nothing of the run is left to own."""
    try:
        kube.delete("v1", "Namespace", namespace_of(run_id))
    except NotFound:
        pass


class RunLease:
    """Creates the Lease and renews it from a thread until `release()`. A renewal is a compare-and-swap on
    the version the last one left; losing the Lease, or a whole duration without a renewal, stops the run."""

    def __init__(
        self, kube: Kube, run_id: str, *, say: Callable[[str], None] = print, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.kube, self.run_id, self.say, self.clock = kube, run_id, say, clock
        self.holder = identity()
        self.duration_s = DURATION_S
        self.renew_every_s = (
            self.duration_s / 4
        )  # four chances to renew within one duration, even with a slow apiserver
        self.lost = ""  # why the run no longer owns its changes, once it does not
        self._version = ""
        self._renewed = 0.0  # clock.monotonic() of the last renewal
        self._stop = threading.Event()
        self._stopping = threading.Lock()  # a release and a stop never interleave
        self._interrupt = threading.current_thread() is threading.main_thread()
        self._thread = threading.Thread(target=self._renew_loop, name="gpucanary-lease", daemon=True)

    def acquire(self) -> RunLease:
        self._version = _create_lease(self.kube, self.run_id, self.holder, self.duration_s)["metadata"][
            "resourceVersion"
        ]
        self._renewed = self.clock.monotonic()
        self._thread.start()
        return self

    def take_over(self, seen: LeaseSeen | None) -> RunLease:
        """Own the Lease of this run, judged dead (`observe`), by compare-and-swap on it as seen, and renew it from
        now on: a sweep resumed by another process. EnvError when someone else took it first."""
        if not take_over(self.kube, self.run_id, seen, self.holder) or (now := read(self.kube, self.run_id)) is None:
            raise EnvError(
                f"run {self.run_id}'s Lease was taken by someone else first",
                hint="another resume or a cleanup is at work on it",
            )
        self._version, self._renewed = now.resource_version, self.clock.monotonic()
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self.clock.wait(self._stop, self.renew_every_s) and self.tick():
            pass

    def tick(self) -> bool:
        """One renewal turn: renew, and stop the run when the Lease is lost or a whole duration went by without a
        renewal. False once the run no longer owns its Lease."""
        try:
            self._renew()
        except Exception:  # noqa: BLE001 - the loop outlives any failure; a lapse is judged below
            pass
        if not self.lost and self.clock.monotonic() - self._renewed >= self.duration_s:
            self._stop_run(f"the Lease was not renewed for {self.duration_s} s")
        return not self.lost

    def _renew(self) -> None:
        try:
            patched = self.kube.patch(
                *LEASE,
                LEASE_NAME,
                {"spec": {"renewTime": _micro_time()}},
                namespace=namespace_of(self.run_id),
                resource_version=self._version,
            )
        except (Conflict, NotFound):
            seen = read(self.kube, self.run_id)
            if seen is None or seen.holder != self.holder:
                self._stop_run(f"its Lease was taken over by {seen.holder if seen else 'nobody (deleted)'}")
            else:
                self._version = seen.resource_version  # renew from the newest version next tick
            return
        self._version = patched["metadata"]["resourceVersion"]
        self._renewed = self.clock.monotonic()

    def _stop_run(self, why: str) -> None:
        with self._stopping:
            if self._stop.is_set():
                return  # released meanwhile: the run is over, there is nothing to interrupt
            self.lost = why
            self.say(f"run {self.run_id} stops: {why}; it restores only what still holds what it wrote")
            if self._interrupt:  # the run unwinds as on Ctrl-C: its restores are conditional writes
                _thread.interrupt_main()

    def stop(self) -> None:
        """Stop renewing and keep the Lease: what the run left stays its own, for a resume or a cleanup to take."""
        with self._stopping:
            self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def release(self) -> None:
        """Stop renewing and delete the Lease's namespace: the run has put everything back."""
        self.stop()
        if self.lost:
            return  # a cleanup owns what is left now
        release(self.kube, self.run_id)
