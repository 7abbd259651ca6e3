"""A live run says so: a coordination.k8s.io Lease, renewed while the run lives.

The run's first write is a namespace of its own holding only this Lease (the workload namespace goes
away before the policy is restored; this one is deleted last), so every change the run makes has a
live owner on the cluster. `gpucanary cleanup` without a run id leaves alone every run whose Lease is
still being renewed, and cleans up only runs whose owner is gone (expired Lease, or none at all).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.kube import Kube, NotFound, owned_labels

LEASE = ("coordination.k8s.io/v1", "Lease")
LEASE_NAME = "gpucanary-run"
DURATION_S = 60          # a run that has not renewed for this long is gone
RENEW_EVERY_S = 15       # four chances to renew within one duration, even with a slow apiserver


def namespace_of(run_id: str) -> str:
    return f"gpucanary-{run_id}-owner"


def _micro_time(at: datetime) -> str:
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class LeaseSeen:
    run_id: str
    holder: str
    renewed: datetime
    duration_s: int

    def live(self, now: datetime) -> bool:
        return now - self.renewed < timedelta(seconds=self.duration_s)


def read(kube: Kube, run_id: str) -> LeaseSeen | None:
    try:
        obj = kube.get(*LEASE, LEASE_NAME, namespace=namespace_of(run_id))
    except NotFound:
        return None
    spec = obj.get("spec", {})
    try:
        return LeaseSeen(run_id, spec.get("holderIdentity", "?"), _parse(spec["renewTime"]),
                         int(spec.get("leaseDurationSeconds", DURATION_S)))
    except (KeyError, ValueError, TypeError):
        return None      # a Lease nobody can read belongs to nobody alive


class RunLease:
    """Creates the Lease and renews it from a thread until `release()`."""

    def __init__(self, kube: Kube, run_id: str) -> None:
        self.kube, self.run_id = kube, run_id
        self.holder = f"{socket.gethostname()}/{os.getpid()}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="gpucanary-lease", daemon=True)

    def acquire(self) -> RunLease:
        now = _micro_time(datetime.now(timezone.utc))
        self.kube.create({"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": namespace_of(self.run_id), "labels": owned_labels(self.run_id)}})
        self.kube.create({"apiVersion": LEASE[0], "kind": LEASE[1],
                          "metadata": {"name": LEASE_NAME, "namespace": namespace_of(self.run_id),
                                       "labels": owned_labels(self.run_id)},
                          "spec": {"holderIdentity": self.holder, "leaseDurationSeconds": DURATION_S,
                                   "acquireTime": now, "renewTime": now}})
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_EVERY_S):
            try:
                self.kube.patch(*LEASE, LEASE_NAME, {"spec": {"renewTime": _micro_time(datetime.now(timezone.utc))}},
                                namespace=namespace_of(self.run_id))
            except GpucanaryError:
                continue     # the next tick tries again; missing a whole duration is what "gone" means

    def release(self) -> None:
        """Stop renewing and delete the Lease's namespace: the run has put everything back."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.kube.delete("v1", "Namespace", namespace_of(self.run_id))
        except NotFound:
            pass
